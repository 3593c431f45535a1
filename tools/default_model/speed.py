"""How fast the embedded model starts and decodes, for ``evaluate_default``: ``LLM()``
timed in fresh processes, as a user's script meets it (``import kvserve`` beside it), and
single-stream greedy decode in steady state."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

READY_SCRIPT = """
import json, sys, time
start = time.perf_counter()
from kvserve import LLM
imported = time.perf_counter()
llm = LLM(sys.argv[1])
ready = time.perf_counter()
llm.engine.close()
print("READY " + json.dumps({"import_s": imported - start, "llm_ready_s": ready - imported}))
"""


def fresh_process_start_up(model_dir: Path, runs: int = 3) -> dict[str, float]:
    """``import kvserve`` and ``LLM(model_dir)`` timed in fresh processes: medians."""
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", READY_SCRIPT, str(model_dir)],
                             capture_output=True, text=True, check=True).stdout
        times.append(json.loads(next(line for line in out.splitlines()
                                     if line.startswith("READY "))[6:]))
    return {key: sorted(t[key] for t in times)[runs // 2] for key in times[0]}


def speed(model_dir: Path) -> dict[str, float]:
    from kvserve import LLM, SamplingParams

    start_up = fresh_process_start_up(model_dir)
    llm = LLM(str(model_dir))
    llm.engine.settle()  # decode timed in steady state, the KV pool's pages backed
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(["def main():\n"], params, use_tqdm=False)  # warm
    steps = []
    for _ in range(3):
        t = time.perf_counter()
        out = llm.generate(["def main():\n"], params, use_tqdm=False)[0]
        steps.append((time.perf_counter() - t) / len(out.outputs[0].token_ids))
    llm.engine.close()
    params_count = _parameters(model_dir)
    ms = 1000 * sorted(steps)[1]
    return {**start_up, "decode_ms_per_token": ms, "parameters": params_count,
            "decode_ms_per_token_per_million_parameters": ms / (params_count / 1e6)}


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
