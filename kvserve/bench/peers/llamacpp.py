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

from kvserve.bench.instruments.cpu_sets import CpuSampler, check_same_cpus
from kvserve.bench.instruments.paired import paired_ratio
from kvserve.bench.workloads.definitions import BenchRequest

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
    import os
    import llama_cpp
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_batch=N_BATCH,
                n_threads=spec["threads"], n_threads_batch=spec["threads"], seed=0,
                verbose=False)
    load_s = time.perf_counter() - t0
    one(llm, spec["prompts"][0][:8], 2)
    info = llama_cpp.llama_print_system_info()
    say({"ready": True, "load_s": load_s, "version": llama_cpp.__version__,
         "system_info": info.decode() if isinstance(info, bytes) else str(info),
         "cpus": sorted(os.sched_getaffinity(0)), "n_threads": spec["threads"],
         "n_batch": N_BATCH, "n_ctx": spec["n_ctx"]})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        say({"requests": [one(llm, p, n) for p, n in zip(spec["prompts"], spec["max_tokens"])]})


MARKER = sys.argv[2]
N_BATCH = 512
main()
'''


def convert_to_gguf(python: str, source: Path, model_dir: Path, out: Path,
                    outtype: str = "f32") -> Path:
    """A GGUF of ``model_dir`` (``outtype``: f32, f16, bf16, q8_0) written by ``source``'s
    converter (run by ``python``)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-gguf-") as tmp:
        script = Path(tmp) / "convert.py"
        script.write_text(CONVERT_SOURCE)
        proc = subprocess.run([python, str(script), str(source), str(model_dir), "--outtype",
                               outtype, "--outfile", str(out)], capture_output=True, text=True)
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
            ready = self._read()
        except BaseException:
            self.close()
            raise
        self.load_s = ready["load_s"]
        self.build = {k: ready[k] for k in ("version", "system_info", "cpus", "n_threads",
                                            "n_batch", "n_ctx")}
        self.build["ggml_features"] = ggml_features(ready["system_info"])

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


def ggml_features(system_info: str) -> dict[str, str]:
    """llama.cpp's system line (``CPU : AVX2 = 1 | AVX512 = 1 | ... |``) as a mapping:
    the features its ggml build was compiled with."""
    features = {}
    for item in system_info.replace(":", "|").split("|"):
        key, eq, value = item.partition("=")
        if eq:
            features[key.strip()] = value.strip()
    return features


def cmake_build_flags(binary: str | Path) -> dict[str, str]:
    """The ``GGML_*`` settings (and the build type) a CMake build of llama.cpp was
    configured with, from the CMakeCache.txt of the build folder holding ``binary``
    (``build/bin/llama-bench``); {} when there is none."""
    for folder in list(Path(binary).resolve().parents)[:3]:
        cache = folder / "CMakeCache.txt"
        if cache.is_file():
            flags = {}
            for line in cache.read_text(errors="replace").splitlines():
                name, sep, value = line.partition("=")
                name = name.split(":", 1)[0]
                if sep and (name.startswith("GGML_") or name == "CMAKE_BUILD_TYPE"):
                    flags[name] = value
            return flags
    return {}


def tool_version(binary: str | Path) -> str | None:
    """The first line of a llama.cpp program's ``--version`` (its version, build number and
    commit, where the source tree knew them)."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0].removeprefix("version: ") if lines else None


LLAMA_BENCH_AGREEMENT = 0.10  # llama-bench and the runner must agree within this share


def run_llama_bench(binary: str, gguf: Path, threads: int, tokens: int = MAX_NEW_TOKENS,
                    repetitions: int = 5, depth: int = 0, prompt: int = 0) -> dict[str, Any]:
    """llama.cpp's own ``llama-bench`` on the same file and threads: tg``tokens`` (decode
    only, after ``depth`` context tokens it does not time), its mean tokens/s, its build,
    and the CPUs its threads ran on. With ``prompt``, pp``prompt`` instead (one prompt of
    that many tokens, computed in one batch): ``pp_tok_s``."""
    cmd = [binary, "-m", str(gguf), "-p", str(prompt), "-n", "0" if prompt else str(tokens),
           "-t", str(threads), "-r", str(repetitions), "-o", "json"] + (
        ["-d", str(depth)] if depth else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with CpuSampler(proc.pid) as sampler:
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {stderr[-2000:]}")
    want = (prompt, 0) if prompt else (0, tokens)
    record = next(r for r in json.loads(stdout)
                  if (r.get("n_prompt", 0), r.get("n_gen")) == want
                  and r.get("n_depth", 0) == depth)
    rate = ({"pp_tok_s": float(record["avg_ts"]), "pp_stddev_tok_s": float(record["stddev_ts"]),
             "n_prompt": prompt} if prompt else
            {"tg_tok_s": float(record["avg_ts"]), "tg_stddev_tok_s": float(record["stddev_ts"]),
             "n_gen": tokens})
    return {"command": " ".join(cmd[:1] + ["-m", "MODEL.gguf"] + cmd[3:]), **rate,
            "n_depth": depth, "n_threads": int(record["n_threads"]),
            "version": tool_version(binary), "build_commit": record.get("build_commit"),
            "build_number": record.get("build_number"), "build_flags": cmake_build_flags(binary),
            "cpu_info": record.get("cpu_info"), "cpus": sampler.usage.to_dict()}


def llama_bench_check(bench: dict[str, Any], runner_rounds: list[dict]) -> dict[str, Any]:
    """llama-bench's decode rate beside the runner's (the median of its rounds' median
    steps): whether they agree within LLAMA_BENCH_AGREEMENT, and if not, a reason."""
    runner = statistics.median(r["decode_tok_s"] for r in runner_rounds)
    ratio = runner / bench["tg_tok_s"]
    agree = abs(ratio - 1) <= LLAMA_BENCH_AGREEMENT
    out = {"runner_decode_tok_s": runner, "llama_bench_tg_tok_s": bench["tg_tok_s"],
           "runner_over_llama_bench": ratio, "agree": agree}
    if not agree:
        out["why"] = (f"the runner's decode rate is {100 * (ratio - 1):+.0f} % against "
                      "llama-bench's; they time different steps: llama-bench's tg from an "
                      "empty context with no sampling, the runner's after each request's "
                      "prompt, a token sampled through the Python binding every step")
    return out


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
                      repeats: int, roofline: dict | None, log=print,
                      llama_bench: str | None = None) -> dict[str, Any]:
    """kvserve and llama.cpp on the same sequential requests, in alternating rounds;
    with ``llama_bench`` (its binary), llama.cpp's own bench on the same file after."""
    from kvserve.bench.instruments.decode import matmul_weight_bytes
    from kvserve.bench.instruments.throughput import load_llm
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
            watch = {"kvserve": CpuSampler(), "llamacpp": CpuSampler(session.proc.pid)}
            for r in range(repeats):
                with watch["kvserve"]:
                    ours = kvserve_sequential(llm, reqs)
                with watch["llamacpp"]:
                    theirs = session.run()
                rounds["kvserve"].append(summarize(ours))
                rounds["llamacpp"].append(summarize(theirs))
                log(f"  single-stream round {r + 1}/{repeats}: kvserve "
                    f"{rounds['kvserve'][-1]['decode_step_ms']:.2f} ms/step, llama.cpp "
                    f"{rounds['llamacpp'][-1]['decode_step_ms']:.2f} ms/step")
            weight_bytes = matmul_weight_bytes(llm.engine.worker.runner.model)
            split = _step_split(before, llm.engine.worker.step_time_stats())
            if llama_bench:
                session.close()  # llama-bench runs alone on the cores
                log("running llama-bench on the same GGUF ...")
                bench = run_llama_bench(llama_bench, Path(gguf), threads)
                watch["llama-bench"] = bench.pop("cpus")
        finally:
            if session is not None:
                session.close()
            llm.engine.close()
    cpus = {name: w if isinstance(w, dict) else w.usage.to_dict() for name, w in watch.items()}
    check_same_cpus(cpus)
    def paired(key: str):
        return paired_ratio([r[key] for r in rounds["kvserve"]],
                            [r[key] for r in rounds["llamacpp"]])
    out = {"requests": len(reqs), "threads": threads, "rounds": rounds,
           "decode_ratio": paired("decode_tok_s"),
           "sequential_ratio": paired("sequential_output_tok_s"),
           "token_agreement": token_agreement(ours, theirs), "llamacpp_load_s": session.load_s,
           "kvserve_profiled_step_ms": split, "llamacpp_build": session.build,
           "cpus": cpus}
    if llama_bench:
        out["llama_bench"] = {**bench, **llama_bench_check(bench, rounds["llamacpp"])}
    if roofline is not None:
        floor_ms = 1000 * weight_bytes / (roofline["sum_bandwidth_gbs"] * 1e9)
        out["stream_floor_ms"] = floor_ms
        for name in rounds:
            step = statistics.median(r["decode_step_ms"] for r in rounds[name])
            out[f"{name}_vs_stream_floor"] = step / floor_ms
    return out
