"""vLLM CPU offline throughput as a peer, run in a subprocess with another venv's python.

vLLM lives in its own venv (it pins its own torch), so the runner script is written
to a temporary directory at run time and started as ``python -m`` there; it loads
the same model in float32, times ``generate`` over the same token-id prompts (greedy,
``ignore_eos``; ``repeats`` times in one process, the prefix cache emptied before each)
and prints a JSON line behind a marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.throughput import ThroughputResult, median_result
from kvserve.bench.workloads import BenchRequest

__all__ = ["RUNNER_SOURCE", "vllm_importable", "run_vllm_throughput"]

MARKER = "KVSERVE_BENCH_RESULT "
RUNNER_MODULE = "kvserve_vllm_runner"

RUNNER_SOURCE = '''"""kvserve bench: vLLM offline throughput runner (generated at run time)."""
import json
import sys
import time


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:
        TokensPrompt = dict
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", seed=0, **spec["engine_args"])
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in spec["max_tokens"]]
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0][:8])], [warm], use_tqdm=False)
    runs = []
    for _ in range(spec["repeats"]):
        if hasattr(llm, "reset_prefix_cache"):  # each repeat computes its prompts
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append({"wall_s": time.perf_counter() - t0,
                     "generated": [len(o.outputs[0].token_ids) for o in outs]})
    print(MARKER + json.dumps({"runs": runs, "load_s": load_s}), flush=True)


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


def run_vllm_throughput(
    python: str | Path,
    model_dir: str | Path,
    requests: Sequence[BenchRequest],
    kv_cache_gib: float = 4.0,
    omp_bind: str = "0-1",
    engine_args: dict[str, Any] | None = None,
    timeout_s: float = 3600.0,
    repeats: int = 1,
) -> tuple[ThroughputResult, list[float]]:
    """Time vLLM's offline ``generate`` over ``requests`` in a subprocess of ``python``,
    ``repeats`` times: the run with the median useful tok/s, and every run's."""
    engine_args = dict(engine_args or {})
    with tempfile.TemporaryDirectory(prefix="kvserve-vllm-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / f"{RUNNER_MODULE}.py").write_text(RUNNER_SOURCE)
        spec = {
            "model": str(Path(model_dir).resolve()),
            "engine_args": engine_args,
            "prompts": [list(r.prompt_token_ids) for r in requests],
            "max_tokens": [r.max_tokens for r in requests],
            "repeats": max(1, repeats),
        }
        spec_path = tmpdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = _env(kv_cache_gib, omp_bind)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmpdir), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [str(python), "-m", RUNNER_MODULE, str(spec_path)],
            cwd=tmpdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise RuntimeError(f"vLLM runner failed (exit {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len(MARKER) :])
    results = [
        ThroughputResult(
            wall_s=float(run["wall_s"]),
            num_requests=len(requests),
            prompt_tokens=sum(r.prompt_len for r in requests),
            useful_output_tokens=sum(min(g, r.max_tokens)
                                     for g, r in zip(run["generated"], requests)),
            generated_tokens=sum(run["generated"]),
            engine_args={"kv_cache_gib": kv_cache_gib, "omp_bind": omp_bind, **engine_args},
            load_s=float(out["load_s"]),
        )
        for run in out["runs"]]
    return median_result(results)
