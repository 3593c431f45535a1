"""The Dockerfile and .dockerignore at the repository root, checked without building.

A small parser below reads the Dockerfile's instructions (line continuations, comments,
exec/JSON and shell forms); the tests check the install order (torch pinned from the CPU
index before the package), the runtime user, entrypoint, port and environment, that the
build context keeps everything the package needs, and that the image agrees with
deploy/kubernetes/deployment.yaml (uid, port, writable paths).
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOYMENT = ROOT / "deploy" / "kubernetes" / "deployment.yaml"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


# ------------------------------------------------------------------------- parser

@dataclass(frozen=True)
class Instruction:
    name: str                       # upper case: RUN, COPY, ...
    value: str                      # the arguments as written, continuations joined
    line: int                       # 1-based line of the instruction's first line
    comments: tuple[str, ...] = ()  # the comment lines right above it

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, else None."""
        if self.value.startswith("["):
            try:
                parsed = json.loads(self.value)
            except json.JSONDecodeError:
                return None
            if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed):
                return parsed
        return None


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. Parser directives and heredocs are not handled (the
    Dockerfile uses neither); comment lines inside a continuation are dropped, as
    Docker does."""
    out: list[Instruction] = []
    comments: list[str] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#"):
            if not parts:
                comments.append(stripped[1:].strip())
            continue
        if not stripped:
            if not parts:
                comments = []  # a blank line ends the comment block above an instruction
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if continued:
            continue
        joined = " ".join(p for p in parts if p)
        name, _, value = joined.partition(" ")
        out.append(Instruction(name.upper(), value.strip(), start, tuple(comments)))
        parts, comments = [], []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return out


def env_vars(instructions: list[Instruction]) -> dict[str, str]:
    """ENV settings, both ``ENV K=V K2=V2`` and the legacy ``ENV K V``."""
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.name != "ENV":
            continue
        words = shlex.split(ins.value)
        if words and "=" not in words[0]:
            env[words[0]] = " ".join(words[1:])
        else:
            env.update(w.split("=", 1) for w in words)
    return env


def dockerignore_patterns(text: str) -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per pattern, in order, with Docker's syntax: ``*`` and
    ``?`` within a path segment, ``**`` across segments, ``!`` re-includes."""
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = pattern.strip("/")
        pattern = pattern.removeprefix("./")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((negate, re.compile(regex + r"\Z")))
    return patterns


def is_ignored(path: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether ``path`` (relative, with /) is left out of the build context: the last
    pattern matching it or one of its parent directories decides."""
    segments = path.strip("/").split("/")
    candidates = ["/".join(segments[:k]) for k in range(1, len(segments) + 1)]
    ignored = False
    for negate, regex in patterns:
        if any(regex.match(c) for c in candidates):
            ignored = not negate
    return ignored


# ------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def ignore() -> list[tuple[bool, re.Pattern]]:
    return dockerignore_patterns(DOCKERIGNORE.read_text())


def only(instructions: list[Instruction], name: str) -> Instruction:
    found = [i for i in instructions if i.name == name]
    assert found, f"no {name}"
    return found[-1]  # the last one is the one that counts


def pip_installs(instructions: list[Instruction]) -> list[tuple[int, Instruction, list[str]]]:
    """(position, RUN, pip arguments) for every ``pip install`` in a RUN."""
    found = []
    for pos, ins in enumerate(instructions):
        if ins.name != "RUN":
            continue
        for command in re.split(r"&&|;|\|\|", ins.value):
            words = shlex.split(command)
            for k in range(len(words) - 1):
                if re.fullmatch(r"(\S*/)?pip3?", words[k]) and words[k + 1] == "install":
                    found.append((pos, ins, words[k + 2:]))
    return found


def requirement_args(pip_args: list[str]) -> list[str]:
    """The requirement / path arguments of ``pip install`` (options and their values
    dropped)."""
    takes_value = {"--index-url", "-i", "--extra-index-url", "-f", "--find-links", "-r",
                   "--requirement", "-c", "--constraint", "--target", "-t", "--prefix",
                   "--root", "--platform", "--python-version"}
    out, skip = [], False
    for arg in pip_args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            # "/src${EXTRAS:+[$EXTRAS]}": the build argument's extras, when given
            out.append(re.sub(r"\$\{(\w+):\+\[\$\1\]\}$", "", arg))
    return out


def copied_paths(instructions: list[Instruction]) -> dict[str, list[str]]:
    """COPY destination -> its sources (build-context paths), for context copies only."""
    out: dict[str, list[str]] = {}
    for ins in instructions:
        if ins.name not in ("COPY", "ADD"):
            continue
        words = ins.exec_form or shlex.split(ins.value)
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        *sources, dest = words
        out.setdefault(dest, []).extend(sources)
    return out


def deployment_container() -> tuple[dict, dict]:
    dep = yaml.safe_load(DEPLOYMENT.read_text())
    spec = dep["spec"]["template"]["spec"]
    container, = [c for c in spec["containers"] if c["name"] == "kvserve"]
    return spec, container


def serve_args(args: list[str]):
    from kvserve.cli import build_parser
    return build_parser().parse_args(["serve", *args])


# -------------------------------------------------------------------- parser tests

def test_parser_handles_continuations_comments_and_forms():
    text = ("# top\nFROM base:1\n\n# why\n# more\nRUN a \\\n  && b \\\n# inside\n  && c\n"
            "ENV A=1 B=\"two words\"\nENV C 3\nCMD [\"x\", \"--y\"]\nUSER 5\n")
    got = parse_dockerfile(text)
    assert [i.name for i in got] == ["FROM", "RUN", "ENV", "ENV", "CMD", "USER"]
    run = got[1]
    assert run.value == "a && b && c" and run.line == 6 and run.comments == ("why", "more")
    assert got[0].comments == ("top",)
    assert env_vars(got) == {"A": "1", "B": "two words", "C": "3"}
    assert got[4].exec_form == ["x", "--y"] and got[5].exec_form is None


def test_dockerignore_matcher():
    pats = dockerignore_patterns("# c\n.venv\n**/__pycache__\n*.egg-info\ndocs\n!docs/keep.md\n")
    assert is_ignored(".venv/bin/python", pats)
    assert is_ignored("__pycache__/a.pyc", pats)
    assert is_ignored("kvserve/x/__pycache__/a.pyc", pats)
    assert is_ignored("kvserve.egg-info/PKG-INFO", pats)
    assert not is_ignored("kvserve/sub.egg-info", pats)  # * stays within one segment
    assert is_ignored("docs/a.png", pats) and not is_ignored("docs/keep.md", pats)
    assert not is_ignored("kvserve/__init__.py", pats)


# ------------------------------------------------------------------ the Dockerfile

def test_base_image(instructions):
    froms = [i for i in instructions if i.name == "FROM"]
    assert froms[-1].value.split()[0] == "python:3.11-slim"


def test_torch_is_pinned_from_the_cpu_index_before_the_package(instructions):
    installs = pip_installs(instructions)
    torch = [(pos, ins, args) for pos, ins, args in installs
             if any(re.match(r"torch\b", r) for r in requirement_args(args))]
    assert len(torch) == 1, "torch is installed by exactly one pip install"
    torch_pos, torch_run, torch_args = torch[0]
    assert requirement_args(torch_args) == ["torch==2.13.0"], "torch alone, pinned"
    assert torch_args[torch_args.index("--index-url") + 1] == TORCH_CPU_INDEX
    assert "--no-cache-dir" in torch_args
    assert any("cuda" in c.lower() for c in torch_run.comments), \
        "a comment above says why (an unpinned torch pulls a CUDA build)"

    makefile_pin = re.search(r"torch==[0-9][0-9.]*", (ROOT / "Makefile").read_text())
    assert makefile_pin and requirement_args(torch_args) == [makefile_pin.group(0)], \
        "the image and the Makefile pin the same torch"

    destinations = copied_paths(instructions)
    package = [(pos, args) for pos, _, args in installs
               if any(r in (".", "./") or r.rstrip("/") in {d.rstrip("/") for d in destinations}
                      for r in requirement_args(args))]
    assert len(package) == 1, "one pip install of the package from the copied source"
    package_pos, package_args = package[0]
    assert torch_pos < package_pos, "torch before the package"
    assert "--no-cache-dir" in package_args
    assert not any(r.startswith("torch") for r in requirement_args(package_args))


def test_build_copies_the_package_source(instructions, ignore):
    """What the install needs is copied, exists, and is not in .dockerignore, package
    data included: the embedded model is baked into the image."""
    sources = [s for srcs in copied_paths(instructions).values() for s in srcs]
    assert {"pyproject.toml", "kvserve"} <= {s.rstrip("/") for s in sources}
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not is_ignored(source, ignore), f".dockerignore excludes {source}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', pyproject, re.MULTILINE)
    if readme:
        assert readme.group(1) in sources, "pyproject's readme is needed to build"
    data = re.search(r"\[tool\.setuptools\.package-data\]\s*kvserve\s*=\s*\[(.*?)\]",
                     pyproject, re.DOTALL)
    assert data, "package-data of kvserve"
    globs = re.findall(r'"([^"]+)"', data.group(1))
    files = [p for g in globs for p in (ROOT / "kvserve").glob(g) if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files), "the embedded model"
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        assert not is_ignored(rel, ignore), f".dockerignore excludes package data {rel}"


def test_dockerignore_excludes_local_state(ignore):
    for path in (".venv/bin/python", ".git/HEAD", "kvserve/__pycache__/cli.cpython-311.pyc",
                 "kvserve.egg-info/PKG-INFO", "build/lib/x.py", ".pytest_cache/v",
                 "tests/deploy/test_dockerfile.py"):
        assert is_ignored(path, ignore), path


def test_runs_as_non_root_owning_the_state_dir(instructions):
    user = only(instructions, "USER").value.split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    assert user.isdigit(), "numeric, so Kubernetes' runAsNonRoot can verify it"
    assert int(user) == 10001
    runs = " ".join(i.value for i in instructions if i.name == "RUN")
    assert re.search(r"useradd\b[^&;]*--uid\s+10001", runs), "the user is created with uid 10001"
    chown = re.search(r"chown\s+(?:-R\s+)?(\S+)\s+([^&;]*)", runs)
    assert chown and chown.group(1).split(":")[0] in ("10001", "kvserve")
    assert "/var/lib/kvserve" in chown.group(2).split()


def test_entrypoint_and_cmd(instructions):
    assert only(instructions, "ENTRYPOINT").exec_form == ["kvserve", "serve"]
    cmd = only(instructions, "CMD").exec_form
    assert cmd is not None, "CMD in exec form, so it is ENTRYPOINT's arguments"
    args = serve_args(cmd)  # kvserve's parser accepts them
    assert (args.host, args.port, args.state_dir) == ("0.0.0.0", 8000, "/var/lib/kvserve")
    assert args.model is None, "the embedded model by default"


def test_exposes_port_8000(instructions):
    exposed = [p.split("/")[0] for i in instructions if i.name == "EXPOSE"
               for p in i.value.split()]
    assert exposed == ["8000"]


def test_offline_environment(instructions):
    env = env_vars(instructions)
    assert env.get("HF_HUB_OFFLINE") == "1"


def test_healthcheck_uses_health(instructions):
    checks = [i for i in instructions if i.name == "HEALTHCHECK"]
    if not checks:
        pytest.skip("no HEALTHCHECK (optional)")
    assert "/health" in checks[-1].value and ":8000" in checks[-1].value


# ---------------------------------------------- the image vs deployment.yaml

def test_image_matches_the_deployment(instructions):
    spec, container = deployment_container()
    assert int(spec["securityContext"]["runAsUser"]) == int(
        only(instructions, "USER").value.split(":")[0])
    exposed = {int(p.split("/")[0]) for i in instructions if i.name == "EXPOSE"
               for p in i.value.split()}
    assert {p["containerPort"] for p in container["ports"]} <= exposed


def test_image_write_paths_are_volumes_in_the_deployment(instructions):
    """The root filesystem is read-only there: the kernel cache the image points
    KVSERVE_CACHE_DIR at must be a writable mount."""
    env = env_vars(instructions)
    _, container = deployment_container()
    if container["securityContext"].get("readOnlyRootFilesystem") is not True:
        pytest.skip("root filesystem writable")
    cache = env.get("KVSERVE_CACHE_DIR")
    assert cache, "the image sets KVSERVE_CACHE_DIR (else ~/.cache, read-only)"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert cache in mounts and not mounts[cache].get("readOnly")


def test_the_ray_image_is_the_same_build_with_extras(instructions):
    args = [ins.value for ins in instructions if ins.name == "ARG"]
    assert 'EXTRAS=""' in args, "no extras unless asked: the plain image has no Ray"
    installs = [args for _, _, args in pip_installs(instructions)]
    assert any(a.endswith("${EXTRAS:+[$EXTRAS]}") for args in installs for a in args)
    wget = [ins for ins in instructions if ins.name == "RUN" and "wget" in ins.value]
    assert wget and '[ -n "$EXTRAS" ]' in wget[0].value, "wget (KubeRay's probes) only then"
    extras = re.search(r"^ray = \[", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extras, "the ray extra the RayService image installs"
