"""llama.cpp as a single-stream peer of ``kvserve bench compare`` (``--against llamacpp``).

llama.cpp is what users pick for local chat on a CPU, one request at a time. Both systems
here serve the workload's first requests one after another, each alone, greedy and
``ignore_eos``, and are timed the same way: the first token (prefill), then each later
token's step. llama.cpp runs through llama-cpp-python in its own venv
(``--llamacpp-python``), on an f32 GGUF of the same model:

- ``--llamacpp-gguf FILE`` uses that file;
- otherwise ``--llamacpp-source DIR`` (a llama.cpp source tree, such as the one
  llama-cpp-python's sdist vendors) converts the model with the ``convert_hf_to_gguf.py``
  it ships, run by this Python (it needs torch and transformers, as the bench does). The bench models' byte-level BPE is GPT-2's pre-tokenizer, which the
  converter cannot recognise from its hash table, so it is declared ``gpt-2``.

The two systems' greedy tokens are compared too: the share of requests whose first
``AGREEMENT_TOKENS`` tokens are equal tells whether the conversion is the same model.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.workloads import BenchRequest

MARKER = "KVSERVE_BENCH_RESULT "
AGREEMENT_TOKENS = 16
MAX_NEW_TOKENS = 128  # per request: enough steps for a stable median, bounded time

CONVERT_SOURCE = '''"""kvserve bench: convert_hf_to_gguf.py with GPT-2's pre-tokenizer declared."""
import runpy
import sys

source = sys.argv[1]
sys.path.insert(0, source)
sys.path.insert(1, source + "/gguf-py")
import conversion.base as base

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sentencepiece_vocab = base.TextModel._set_vocab_sentencepiece


def byte_level_bpe_unless_sentencepiece(self, *args, **kwargs):
    # the converter tries SentencePiece first and expects FileNotFoundError without
    # tokenizer.model; it imports sentencepiece before looking, which may not be installed
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model: a byte-level BPE")
    return sentencepiece_vocab(self, *args, **kwargs)


base.TextModel._set_vocab_sentencepiece = byte_level_bpe_unless_sentencepiece
sys.argv = [source + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''

RUNNER_SOURCE = '''"""kvserve bench: llama-cpp-python single-stream runner (generated at run time)."""
import json
import sys
import time


def say(obj):
    print(MARKER + json.dumps(obj), flush=True)


def one(llm, prompt, max_tokens):
    llm.reset()
    start = last = time.perf_counter()
    tokens, steps, ttft = [], [], None
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - start
        else:
            steps.append(now - last)
        last = now
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    return {"ttft_s": ttft, "steps_s": steps, "total_s": last - start, "tokens": tokens}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_batch=512,
                n_threads=spec["threads"], n_threads_batch=spec["threads"], seed=0,
                verbose=False)
    load_s = time.perf_counter() - t0
    one(llm, spec["prompts"][0][:8], 2)
    say({"ready": True, "load_s": load_s})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        say({"requests": [one(llm, p, n) for p, n in zip(spec["prompts"], spec["max_tokens"])]})


MARKER = sys.argv[2]
main()
'''


def convert_to_gguf(python: str, source: Path, model_dir: Path, out: Path) -> Path:
    """An f32 GGUF of ``model_dir`` written by ``source``'s converter (run by ``python``)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-gguf-") as tmp:
        script = Path(tmp) / "convert.py"
        script.write_text(CONVERT_SOURCE)
        proc = subprocess.run([python, str(script), str(source), str(model_dir), "--outtype",
                               "f32", "--outfile", str(out)], capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {proc.stderr[-2000:]}")
    return out


def summarize(requests: list[dict]) -> dict[str, Any]:
    """Both systems' per-request timings -> the figures compared."""
    steps = [s for r in requests for s in r["steps_s"]]
    total = sum(r["total_s"] for r in requests)
    outputs = sum(len(r["tokens"]) for r in requests)
    median = statistics.median(steps) if steps else float("nan")
    return {"decode_step_ms": 1000 * median, "decode_tok_s": 1 / median if steps else 0.0,
            "sequential_output_tok_s": outputs / total if total else 0.0,
            "median_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in requests),
            "requests": len(requests)}


class LlamaCppSession:
    """The runner, loaded once; :meth:`run` serves the requests again."""

    def __init__(self, python: str, gguf: Path, requests: Sequence[BenchRequest],
                 threads: int, n_ctx: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvserve-llamacpp-")
        tmp = Path(self._tmp.name)
        (tmp / "runner.py").write_text(RUNNER_SOURCE)
        spec = {"gguf": str(gguf), "threads": threads, "n_ctx": n_ctx,
                "prompts": [list(r.prompt_token_ids) for r in requests],
                "max_tokens": [r.max_tokens for r in requests]}
        (tmp / "spec.json").write_text(json.dumps(spec))
        self._stderr = open(tmp / "stderr.log", "w+")  # a file: a full pipe would stall it
        self.proc = subprocess.Popen([python, str(tmp / "runner.py"), str(tmp / "spec.json"),
                                      MARKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        try:
            self.load_s = self._read()["load_s"]
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
        self._stderr.seek(0)
        raise RuntimeError(f"llama.cpp runner exited: {self._stderr.read()[-2000:]}")

    def run(self) -> list[dict]:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()["requests"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._stderr.close()
        self._tmp.cleanup()


def kvserve_sequential(llm, requests: Sequence[BenchRequest]) -> list[dict]:
    """The same timings from kvserve's engine: each request alone, step by step, its
    prompt computed (the prefix cache is emptied first, as llama.cpp's is reset)."""
    from kvserve import SamplingParams

    engine = llm.engine
    engine.reset_prefix_cache()
    out = []
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        start = last = time.perf_counter()
        engine.add_request(f"seq-{i}", {"prompt_token_ids": list(req.prompt_token_ids)},
                           params)
        ttft, steps, tokens = None, [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens = list(o.outputs[0].token_ids)
            now = time.perf_counter()
            if tokens and ttft is None:
                ttft = now - start
            elif ttft is not None:
                steps.append(now - last)
            last = now
        out.append({"ttft_s": ttft, "steps_s": steps, "total_s": last - start,
                    "tokens": tokens})
    return out


def token_agreement(ours: list[dict], theirs: list[dict]) -> float:
    same = sum(a["tokens"][:AGREEMENT_TOKENS] == b["tokens"][:AGREEMENT_TOKENS]
               for a, b in zip(ours, theirs))
    return same / len(ours) if ours else 0.0


def sequential_requests(requests: Sequence[BenchRequest], count: int) -> list[BenchRequest]:
    """The workload's first ``count`` requests, outputs capped at MAX_NEW_TOKENS."""
    return [BenchRequest(r.prompt_token_ids, min(r.max_tokens, MAX_NEW_TOKENS))
            for r in requests[:count]]


def _step_split(before, after) -> dict[str, float]:
    """kvserve's profiled steps (one in ``step_profile_interval``) by part, in ms a step:
    linear layers, attention, and the rest of the worker's step. The profiler's hooks
    add a little to the steps they time; the engine's work outside the worker
    (scheduling, output processing) is the measured step minus their sum."""
    steps = after.profiled_steps - before.profiled_steps
    if steps <= 0:
        return {}
    parts = after.by_part()
    return {part: 1000 * (parts[part] - before.by_part()[part]) / steps for part in parts}


def run_single_stream(model_dir: Path, requests: Sequence[BenchRequest], engine_args: dict,
                      python: str, gguf: str | None, source: str | None, count: int,
                      repeats: int, roofline: dict | None, log=print) -> dict[str, Any]:
    """kvserve and llama.cpp on the same sequential requests, in alternating rounds."""
    from kvserve.bench.decode import matmul_weight_bytes
    from kvserve.bench.throughput import load_llm
    from kvserve.worker.platform import physical_cores

    if engine_args.get("speculative_config"):
        raise ValueError("--against llamacpp times one token a step: run it without "
                         "speculative decoding")
    reqs = sequential_requests(requests, count)
    with tempfile.TemporaryDirectory(prefix="kvserve-llamacpp-") as tmp:
        if gguf is None:
            if source is None:
                raise ValueError("--against llamacpp needs --llamacpp-gguf or --llamacpp-source")
            log("converting the model to an f32 GGUF ...")
            gguf = str(convert_to_gguf(sys.executable, Path(source), Path(model_dir),
                                       Path(tmp) / "model-f32.gguf"))
        threads = engine_args.get("num_threads") or physical_cores()
        n_ctx = max(r.prompt_len + r.max_tokens for r in reqs) + 16
        llm, _ = load_llm(str(model_dir), engine_args)
        rounds: dict[str, list[dict]] = {"kvserve": [], "llamacpp": []}
        session = None
        try:
            session = LlamaCppSession(python, Path(gguf), reqs, threads, n_ctx)
            kvserve_sequential(llm, reqs[:1])  # warm, as the runner warms llama.cpp
            before = llm.engine.worker.step_time_stats()
            for r in range(repeats):
                ours, theirs = kvserve_sequential(llm, reqs), session.run()
                rounds["kvserve"].append(summarize(ours))
                rounds["llamacpp"].append(summarize(theirs))
                log(f"  single-stream round {r + 1}/{repeats}: kvserve "
                    f"{rounds['kvserve'][-1]['decode_step_ms']:.2f} ms/step, llama.cpp "
                    f"{rounds['llamacpp'][-1]['decode_step_ms']:.2f} ms/step")
            weight_bytes = matmul_weight_bytes(llm.engine.worker.runner.model)
            split = _step_split(before, llm.engine.worker.step_time_stats())
        finally:
            if session is not None:
                session.close()
            llm.engine.close()
    ratios = [a["decode_tok_s"] / b["decode_tok_s"] if b["decode_tok_s"] else float("nan")
              for a, b in zip(rounds["kvserve"], rounds["llamacpp"])]
    seq = [a["sequential_output_tok_s"] / b["sequential_output_tok_s"]
           if b["sequential_output_tok_s"] else float("nan")
           for a, b in zip(rounds["kvserve"], rounds["llamacpp"])]
    out = {"requests": len(reqs), "threads": threads, "rounds": rounds,
           "decode_ratio_rounds": ratios, "decode_ratio": statistics.median(ratios),
           "sequential_ratio_rounds": seq, "sequential_ratio": statistics.median(seq),
           "token_agreement": token_agreement(ours, theirs), "llamacpp_load_s": session.load_s,
           "kvserve_profiled_step_ms": split}
    if roofline is not None:
        floor_ms = 1000 * weight_bytes / (roofline["sum_bandwidth_gbs"] * 1e9)
        out["stream_floor_ms"] = floor_ms
        for name in rounds:
            step = statistics.median(r["decode_step_ms"] for r in rounds[name])
            out[f"{name}_vs_stream_floor"] = step / floor_ms
    return out
