"""vLLM CPU offline throughput as a peer, run in a subprocess with another venv's python.

vLLM lives in its own venv (it pins its own torch), so the runner script is written
to a temporary directory at run time and started as ``python -m`` there. It loads the
same model in float32 (or the ``dtype`` its engine arguments name), warms up, says it is ready, and then times one ``generate`` over
the same token-id prompts (greedy, ``ignore_eos``; the prefix cache emptied first) for
every ``run`` line it reads on stdin, printing each result as a JSON line behind a
marker. The model stays loaded between runs, so that ``bench compare`` can alternate
kvserve's runs with vLLM's (see :class:`VllmSession`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Sequence

from kvserve.bench.instruments.cpu_sets import CpuSampler
from kvserve.bench.instruments.throughput import ThroughputResult, median_result
from kvserve.bench.workloads.definitions import BenchRequest

__all__ = ["RUNNER_SOURCE", "VllmSession", "vllm_importable", "vllm_version",
           "run_vllm_throughput"]

MARKER = "KVSERVE_BENCH_RESULT "
RUNNER_MODULE = "kvserve_vllm_runner"

RUNNER_SOURCE = '''"""kvserve bench: vLLM offline throughput runner (generated at run time)."""
import json
import sys
import time


def say(obj):
    print(MARKER + json.dumps(obj), flush=True)


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:
        TokensPrompt = dict
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], seed=0, **{"dtype": "float32", **spec["engine_args"]})
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in spec["max_tokens"]]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])], [warm], use_tqdm=False)
    import os
    import torch
    import vllm
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    say({"ready": True, "load_s": load_s, "version": getattr(vllm, "__version__", None),
         "torch_version": torch.__version__, "cpus": sorted(os.sched_getaffinity(0)),
         "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))},
         "engine_config": str(config)[:4000] if config is not None else None})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        if hasattr(llm, "reset_prefix_cache"):  # each run computes its prompts
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        say({"wall_s": time.perf_counter() - t0,
             "generated": [len(o.outputs[0].token_ids) for o in outs]})


MARKER = "%s"

if __name__ == "__main__":
    main()
''' % MARKER


def _env(kv_cache_gib: float, omp_bind: str) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def vllm_importable(python: str | Path, timeout_s: float = 300.0) -> bool:
    """Whether ``python`` can ``import vllm``."""
    try:
        proc = subprocess.run(
            [str(python), "-c", "import vllm"],
            capture_output=True,
            timeout=timeout_s,
            env=_env(1, "0-1"),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def vllm_version(python: str | Path, timeout_s: float = 300.0) -> str | None:
    """The version of vLLM that ``python`` imports (None when it cannot)."""
    try:
        proc = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                              capture_output=True, text=True, timeout=timeout_s,
                              env=_env(1, "0-1"))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() \
        else None


class VllmSession:
    """vLLM loaded in a subprocess of ``python``, timing ``requests`` on each :meth:`run`.

    Use as a context manager; the subprocess ends on exit. Raises RuntimeError with the
    tail of vLLM's log when it fails to start, a run fails, or the start or a run takes
    longer than ``timeout_s``.
    """

    def __init__(self, python: str | Path, model_dir: str | Path,
                 requests: Sequence[BenchRequest], kv_cache_gib: float = 4.0,
                 omp_bind: str = "0-1", engine_args: dict[str, Any] | None = None,
                 timeout_s: float = 3600.0) -> None:
        self.requests = list(requests)
        self.timeout_s = timeout_s
        self.engine_args = {"kv_cache_gib": kv_cache_gib, "omp_bind": omp_bind,
                            **(engine_args or {})}
        self._tmp = tempfile.TemporaryDirectory(prefix="kvserve-vllm-")
        tmpdir = Path(self._tmp.name)
        (tmpdir / f"{RUNNER_MODULE}.py").write_text(RUNNER_SOURCE)
        spec = {
            "model": str(Path(model_dir).resolve()),
            "engine_args": dict(engine_args or {}),
            "prompts": [list(r.prompt_token_ids) for r in self.requests],
            "max_tokens": [r.max_tokens for r in self.requests],
        }
        (tmpdir / "spec.json").write_text(json.dumps(spec))
        env = _env(kv_cache_gib, omp_bind)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmpdir), env.get("PYTHONPATH")]))
        # vLLM logs a lot: to a file, which a pipe nobody reads could not take
        self._log: IO[str] = open(tmpdir / "vllm.log", "w+")
        self._proc = subprocess.Popen(
            [str(python), "-m", RUNNER_MODULE, str(tmpdir / "spec.json")], cwd=tmpdir,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True)
        try:
            ready = self._read()
        except RuntimeError:
            self.close()
            raise
        self.load_s = float(ready["load_s"])
        self.build = {"engine_args": self.engine_args,
                      **{k: ready.get(k) for k in ("version", "torch_version", "cpus", "env",
                                                   "engine_config")}}
        self.cpu_sampler = CpuSampler(self._proc.pid)  # its runs, EngineCore process included

    def _read(self) -> dict[str, Any]:
        """The next result line; RuntimeError when the runner ends (or is stopped for
        taking longer than timeout_s) first."""
        assert self._proc.stdout is not None
        watchdog = threading.Timer(self.timeout_s, self._proc.kill)
        watchdog.start()
        try:
            for line in self._proc.stdout:
                if line.startswith(MARKER):
                    return json.loads(line[len(MARKER):])
        finally:
            watchdog.cancel()
        code = self._proc.wait()
        self._log.seek(0)
        raise RuntimeError(f"vLLM runner failed (exit {code}):\n{self._log.read()[-2000:]}")

    def run(self) -> ThroughputResult:
        """One timed ``generate`` over the requests."""
        assert self._proc.stdin is not None
        with self.cpu_sampler:
            try:
                self._proc.stdin.write("run\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                pass  # the runner ended: _read reports why
            run = self._read()
        return ThroughputResult(
            wall_s=float(run["wall_s"]),
            num_requests=len(self.requests),
            prompt_tokens=sum(r.prompt_len for r in self.requests),
            useful_output_tokens=sum(min(g, r.max_tokens)
                                     for g, r in zip(run["generated"], self.requests)),
            generated_tokens=sum(run["generated"]),
            engine_args=dict(self.engine_args),
            load_s=self.load_s,
        )

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # type: ignore[union-attr]
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> "VllmSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_vllm_throughput(
    python: str | Path,
    model_dir: str | Path,
    requests: Sequence[BenchRequest],
    kv_cache_gib: float = 4.0,
    omp_bind: str = "0-1",
    engine_args: dict[str, Any] | None = None,
    repeats: int = 1,
    timeout_s: float = 3600.0,
) -> tuple[ThroughputResult, list[float]]:
    """vLLM's offline throughput over ``requests``, ``repeats`` runs in one process: the
    run with the median useful tok/s, and every run's."""
    with VllmSession(python, model_dir, requests, kv_cache_gib, omp_bind, engine_args,
                     timeout_s) as vllm:
        return median_result([vllm.run() for _ in range(max(1, repeats))])
