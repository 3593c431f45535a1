"""The figures the README and docs/figures.md publish, generated from results JSON.

``kvserve bench report`` reads every JSON under ``docs/results/``, groups them by the
machine that wrote them (CPU name, family, model, vector ISA, cores) and prints, for each
machine, the headline table: ``bench compare``'s offline ``mixed`` run against vLLM and HF
transformers (with its single-stream run against llama.cpp and llama-bench's cross-check)
and ``bench serving``'s run at a fixed request rate against vLLM, and ``bench
startup``'s start with a saved tuning plan against one that measures, ``bench
gguf-decode``'s single stream on quantized GGUF files against llama-bench, and ``bench
memory``'s KV held per request with and without KV groups, and ``bench moe``'s
mixture-of-experts decode against a dense model of its size, and ``bench sinks``'s
perplexity past the training context with and without attention sinks, and ``bench
lora``'s decode steps over four adapters against the base alone, and the embedded model
judged on held-out code (``tools.default_model.evaluate_default``). The README's
"Performance" section is the headline table of the machine measured last, its embedded
model's figures the newest such run;
docs/figures.md's "Current figures" holds every machine's figures. A test checks that both are exactly what this
module prints from the files, so no figure is typed by hand. ``--write`` puts them there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kvserve.bench.reports.figure_lines import LINES_OF, machine_title

__all__ = ["Result", "load_results", "machine_sections", "readme_section",
           "performance_section", "embedded_model_section", "write_sections",
           "cited_results", "cmd_report"]

STATISTIC = ("a ratio is the median of per-round ratios of alternating rounds, min–max "
             "beside it ([statistics]({stats}))")


@dataclass
class Result:
    path: Path          # as cited: relative to the repository root
    data: dict[str, Any]

    @property
    def model_key(self) -> str | None:
        """The model, and a decode bench's context depth where it has one: results kept
        a model each keep each depth apart."""
        depth = self.data.get("result", {}).get("depth") if isinstance(
            self.data.get("result"), dict) else None
        model = self.data.get("model")
        return f"{model} @ {depth}" if depth else model

    @property
    def machine(self) -> dict[str, Any]:
        return self.data.get("machine", {})

    @property
    def kind(self) -> str | None:
        if "rows" in self.data:
            return "compare"
        if {"kvserve_over_peer", "kvserve_over_vllm"} & set(self.data.get("result", {})):
            return "serving"
        if "round_start_s" in self.data.get("result", {}):
            return "startup"
        if "kv_blocks" in self.data and "results" in self.data:
            return "memory"
        if "dense_over_moe" in self.data.get("result", {}):
            return "moe"
        if "perplexity_past_training_context" in self.data.get("result", {}):
            return "sinks"
        if "lora_over_base" in self.data.get("result", {}):
            return "lora"
        if "stream_bandwidth_gbs" in self.data.get("result", {}):
            return "gguf_decode"
        if "baseline_build_flags" in self.data.get("result", {}):
            return "gguf_vnni"
        if {"formats", "memory_bytes"} <= set(self.data.get("result", {})):
            return "gguf_layouts"
        if "repetition" in (self.data.get("result", {}).get("model") or {}):
            return "default_model"
        return None

    @property
    def machine_key(self) -> tuple:
        m = self.machine
        return (m.get("cpu_model"), m.get("cpu_family"), m.get("cpu_model_number"),
                m.get("vector_isa"), m.get("physical_cores"))


@dataclass
class MachineResults:
    machine: dict[str, Any]
    compare: dict[str, Result] = field(default_factory=dict)  # by model
    serving: dict[str, Result] = field(default_factory=dict)  # by model
    startup: dict[str, Result] = field(default_factory=dict)  # by model
    memory: Result | None = None
    moe: Result | None = None
    sinks: Result | None = None
    lora: Result | None = None
    default_model: Result | None = None
    gguf_layouts: Result | None = None
    gguf_vnni: Result | None = None
    gguf_decode: dict[str, Result] = field(default_factory=dict)  # by model
    others: list[Result] = field(default_factory=list)

    @property
    def date(self) -> str:
        return max(r.machine.get("date_utc") or "" for r in self.results)

    @property
    def results(self) -> list[Result]:
        return [r for r in (self.memory, self.moe, self.sinks, self.lora, self.default_model,
                            self.gguf_layouts, self.gguf_vnni,
                            *self.compare.values(), *self.serving.values(), *self.startup.values(),
                            *self.gguf_decode.values(), *self.others)
                if r is not None]


def load_results(root: Path) -> list[Result]:
    """Every results JSON under ``root``/docs/results, paths relative to ``root``."""
    results = []
    for path in sorted((root / "docs" / "results").rglob("*.json")):
        results.append(Result(path.relative_to(root), json.loads(path.read_text())))
    return results


def _by_machine(results: Iterable[Result]) -> list[MachineResults]:
    """One entry a machine, the newest result of each headline kind (of gguf-decode's,
    each model's); the machine measured last first."""
    groups: dict[tuple, MachineResults] = {}
    for res in sorted(results, key=lambda r: r.machine.get("date_utc") or ""):
        group = groups.setdefault(res.machine_key, MachineResults(res.machine))
        if res.kind in BY_MODEL:
            by_model = getattr(group, res.kind)
            older = by_model.get(res.model_key)
            if older is not None:
                group.others.append(older)
            by_model[res.model_key] = res
        elif res.kind in KINDS:
            older = getattr(group, res.kind)
            if older is not None:
                group.others.append(older)
            setattr(group, res.kind, res)
        else:
            group.others.append(res)
    return sorted(groups.values(), key=lambda g: g.date, reverse=True)


KINDS = ("compare", "serving", "gguf_decode", "gguf_layouts", "gguf_vnni", "startup", "memory",
         "moe", "sinks", "lora", "default_model")
BY_MODEL = ("compare", "gguf_decode", "startup", "serving")  # the kinds kept a model each


def machine_sections(results: Iterable[Result], base: str = ".",
                     kinds: tuple[str, ...] = KINDS, needs: str | None = None
                     ) -> list[list[str]]:
    """Each machine's lines of the ``kinds`` of results it has (in that order), the
    machine measured last first, only machines with a result of kind ``needs`` if given;
    ``base``: the folder of the document the links are written from, relative to the
    repository."""
    lines_of = LINES_OF
    out = []
    for group in _by_machine(results):
        if needs is not None and not getattr(group, needs):
            continue
        present = [k for k in kinds if getattr(group, k)
                   and lines_of[k](getattr(group, k), base)]
        if not present:
            continue
        lines = [f"**{machine_title(group.machine)}**", ""]
        for kind in present:
            lines += lines_of[kind](getattr(group, kind), base)
        if lines[2] == "":
            del lines[2]  # the first figure's own blank line
        out.append(lines)
    return out


def readme_section(results: list[Result]) -> str:
    """The README's "## Performance" section (heading included): the headline table of
    the machine that ran ``bench compare`` last, with its serving figures; then the
    quantized sizes (and their serving) of the machine that measured them last."""
    sections = machine_sections(results, kinds=("compare", "serving"), needs="compare")
    body = sections[0] if sections else ["No figures are published for the current code."]
    quantized = machine_sections(results, kinds=("gguf_decode", "serving"), needs="gguf_decode")
    if quantized:
        if quantized[0][0] == body[0]:  # the same machine: its serving is shown already
            quantized = machine_sections(results, kinds=("gguf_decode",), needs="gguf_decode")
            body = [*body, "", *quantized[0][2:]]
        else:
            body = [*body, "", *quantized[0]]
    return "\n".join(["## Performance", "",
                      "From `kvserve bench` at the commit named with each figure; "
                      + STATISTIC.format(stats="docs/statistics.md") + ". Other machines: "
                      "[docs/figures.md](docs/figures.md); methods, design: "
                      "[docs/performance.md](docs/performance.md).", "",
                      *body]) + "\n"


def performance_section(results: list[Result]) -> str:
    """docs/figures.md's "## Current figures" section (heading included)."""
    sections = machine_sections(results, base="docs")
    body: list[str] = []
    for lines in sections:
        body += [*lines, ""]
    if not body:
        body = ["No figures are published for the current code.", ""]
    return "\n".join(["## Current figures", "",
                      "Generated by `kvserve bench report` from the results JSON under "
                      "[results/](results/); " + STATISTIC.format(stats="statistics.md") + ".",
                      "", *body])


EMBEDDED_HEADING = "### Measured on code it never saw"


def embedded_model_section(results: list[Result]) -> str:
    """The README's figures of the embedded model (heading included): the newest
    ``evaluate_default`` run, whichever machine ran it."""
    runs = sorted((r for r in results if r.kind == "default_model"),
                  key=lambda r: r.machine.get("date_utc") or "")
    if not runs:
        return f"{EMBEDDED_HEADING}\n\nNo figures are published for the current model.\n"
    newest = runs[-1]
    lines = LINES_OF["default_model"](newest, ".")
    return "\n".join([EMBEDDED_HEADING, "", f"On {machine_title(newest.machine)}:", *lines]) + "\n"


def _bounds(text: str, heading: str) -> tuple[int, int]:
    """Where the section under ``heading`` starts and ends: up to the newline before the
    next "## " heading, or the end of the text."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return start, len(text) if end < 0 else end


def section_of(text: str, heading: str) -> str:
    """The section under ``heading``, heading included."""
    start, end = _bounds(text, heading)
    return text[start:end]


def replace_section(text: str, heading: str, section: str) -> str:
    """``text`` with the section under ``heading`` replaced by ``section``."""
    start, end = _bounds(text, heading)
    return text[:start] + section + text[end:]


def write_sections(root: Path) -> list[Path]:
    """Regenerate the sections in place; returns the files changed."""
    results = load_results(root)
    changed = []
    for rel, heading, section in (("README.md", "## Performance", readme_section(results)),
                                  ("README.md", EMBEDDED_HEADING,
                                   embedded_model_section(results)),
                                  ("docs/figures.md", "## Current figures",
                                   performance_section(results))):
        path = root / rel
        text = path.read_text()
        if heading + "\n" not in text:  # a document without the section does not publish it
            continue
        new = replace_section(text, heading, section)
        if new != text:
            path.write_text(new)
            if path not in changed:
                changed.append(path)
    return changed


def cited_results(root: Path) -> set[Path]:
    """The files under docs/results/ that the README and the docs link to."""
    import re

    cited = set()
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = (doc.parent / target).resolve()
            results = (root / "docs" / "results").resolve()
            if results in path.parents:
                cited.add(path.relative_to(root.resolve()))
    return cited


def cmd_report(args) -> int:
    """``kvserve bench report``: the published figures, regenerated from docs/results/."""
    from kvserve.bench.reports.provenance import REPO_ROOT

    root = Path(args.root) if args.root else REPO_ROOT
    if root is None:
        raise SystemExit("kvserve: error: not run from a checkout: give --root REPOSITORY")
    if args.write:
        for path in write_sections(root):
            print(f"wrote {path}")
        return 0
    results = load_results(root)
    print(readme_section(results))
    print(embedded_model_section(results))
    print(performance_section(results))
    return 0
