"""``kvserve bench gguf-decode``: one stream's decode speed on GGUF files, kvserve
against llama.cpp's own ``llama-bench`` on the same file, threads and cores.

Each round times both systems on each file, one after the other:

- kvserve: one request with a one-token prompt generates ``tokens`` tokens after its
  first; its rate is those tokens over the time of their steps.
- llama.cpp: ``llama-bench -p 0 -n TOKENS -r 1`` (its tg test: each token one decode
  call, from its own warm-up), its rate as it reports it.

With ``--prompt-tokens N`` each round also times one prompt of N tokens:

- kvserve: one request of N tokens (the prefix cache emptied first) to its first token,
  N over that time;
- llama.cpp: ``llama-bench -p N -n 0 -r 1`` (its pp test), its rate as it reports it.

A file's figure is the median of its rounds' ratios (kvserve over llama.cpp). The floor
is the bytes one decode step must read, the file's weights that take part in a matmul
(every tensor but the token embedding, unless the embedding is the LM head too), over
the streaming read bandwidth, measured again in each round beside the two systems (a
shared machine's bandwidth moves by a fifth within minutes): each system's step over
its round's floor says how close to the memory it runs, the median of the rounds
again.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from kvserve.bench.instruments.cpu_sets import CpuSampler, check_same_cpus
from kvserve.bench.instruments.paired import describe_ratio, paired_ratio, ratio_cell

DEFAULT_TOKENS = 128


def decode_weight_bytes(path: Path) -> dict[str, Any]:
    """Bytes a decode step reads of the GGUF file ``path``, and its tensors' formats. Of a
    mixture of experts' tensors a token reads its routed experts' share (expert_used_count
    of expert_count)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = reader.tensors
    arch = reader.fields["general.architecture"].contents()
    experts = {key: reader.fields[f"{arch}.{key}"].contents()
               for key in ("expert_used_count", "expert_count") if f"{arch}.{key}" in reader.fields}
    used, count = experts.get("expert_used_count", 1), experts.get("expert_count", 1)
    names = {t.name for t in tensors}
    embedding_read = "output.weight" not in names  # tied: the table is the LM head
    total, formats = 0, {}
    for t in tensors:
        kind = t.tensor_type.name
        formats[kind] = formats.get(kind, 0) + int(t.n_bytes)
        if t.name.endswith("_exps.weight"):
            total += int(t.n_bytes) * used // count
        elif t.name != "token_embd.weight" or embedding_read:
            total += int(t.n_bytes)
    return {"decode_bytes": total, "bytes_by_format": formats}


def context_prompt(bos: int, depth: int, vocab: int) -> list[int]:
    """A prompt of ``depth`` tokens after ``bos``: the context the timed steps attend to
    (ids counted up through the vocabulary; their values do not change a step's work)."""
    return [bos] + [(bos + 1 + i) % vocab for i in range(depth)]


def kvserve_decode_rate(llm, tokens: int, prompt: Sequence[int],
                        reset_prefix_cache: bool = True) -> float:
    """Tokens per second of one request's decode steps after its first token (the
    prompt's steps, however many chunks it takes, are not timed). With the prefix cache
    kept, a prompt computed before is found there instead of computed again."""
    from kvserve import SamplingParams

    engine = llm.engine
    if reset_prefix_cache:
        engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    request_id = f"gguf-decode-{time.monotonic_ns()}"
    engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
    while not any(o.request_id == request_id and o.outputs[0].token_ids
                  for o in engine.step()):
        pass  # the prompt, and the first token
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def kvserve_prompt_rate(llm, prompt: Sequence[int]) -> float:
    """Tokens per second of one prompt computed from nothing (the prefix cache emptied),
    up to its first token."""
    from kvserve import SamplingParams

    engine = llm.engine
    engine.reset_prefix_cache()
    request_id = f"gguf-prompt-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": list(prompt)},
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def run_gguf_decode(files: Sequence[Path], llama_bench: str, rounds: int, tokens: int,
                    threads: int, engine_args: dict[str, Any], depth: int = 0,
                    prompt_tokens: int = 0, log=print) -> dict[str, Any]:
    from kvserve.bench.instruments.roofline import measure_apart
    from kvserve.bench.instruments.throughput import load_llm
    from kvserve.bench.peers.llamacpp import run_llama_bench

    results, cpus, build, bandwidths = {}, {}, None, []
    for path in files:
        read = decode_weight_bytes(path)
        llm, load_s = load_llm(str(path), engine_args)
        try:
            prompt = context_prompt(llm.engine.tokenizer.bos_token_id or 0, depth,
                                    llm.engine.vocab_size)
            kvserve_decode_rate(llm, 16, prompt)  # warm (and a deep context computed once)
            if prompt_tokens:  # ids counted up from BOS, as the context's
                long_prompt = context_prompt(prompt[0], prompt_tokens - 1, llm.engine.vocab_size)
                kvserve_prompt_rate(llm, long_prompt)  # warm
            ours, theirs, round_bandwidth = [], [], []
            ours_pp, theirs_pp = [], []
            watch = {"kvserve": CpuSampler(), "llama-bench": None}
            for r in range(rounds):
                round_bandwidth.append(measure_apart("measure_stream_bandwidth"))
                with watch["kvserve"]:
                    ours.append(kvserve_decode_rate(llm, tokens, prompt,
                                                    reset_prefix_cache=depth == 0))
                bench = run_llama_bench(llama_bench, path, threads, tokens, repetitions=1,
                                        depth=depth)
                watch["llama-bench"] = bench.pop("cpus")
                build = {k: bench[k] for k in ("version", "build_commit", "build_number",
                                               "build_flags", "cpu_info")}
                theirs.append(bench["tg_tok_s"])
                log(f"  {path.name} round {r + 1}/{rounds}: kvserve {ours[-1]:.2f} tok/s, "
                    f"llama.cpp {theirs[-1]:.2f} tok/s, streaming read "
                    f"{round_bandwidth[-1]:.1f} GB/s")
                if prompt_tokens:
                    with watch["kvserve"]:
                        ours_pp.append(kvserve_prompt_rate(llm, long_prompt))
                    theirs_pp.append(run_llama_bench(llama_bench, path, threads, repetitions=1,
                                                     prompt=prompt_tokens)["pp_tok_s"])
                    log(f"  {path.name} round {r + 1}/{rounds}: pp{prompt_tokens} kvserve "
                        f"{ours_pp[-1]:.1f} tok/s, llama.cpp {theirs_pp[-1]:.1f} tok/s")
        finally:
            llm.engine.close()
        cpus[path.name] = {"kvserve": watch["kvserve"].usage.to_dict(),
                           "llama-bench": watch["llama-bench"]}
        check_same_cpus(cpus[path.name])
        bandwidths += round_bandwidth
        ratio = paired_ratio(ours, theirs)
        step = {"kvserve": 1000 / statistics.median(ours),
                "llamacpp": 1000 / statistics.median(theirs)}
        # a round's floor in tokens/s: its streaming read over the step's bytes
        floor_rates = [gbs * 1e9 / read["decode_bytes"] for gbs in round_bandwidth]
        vs_floor = {"kvserve": paired_ratio(floor_rates, ours),
                    "llamacpp": paired_ratio(floor_rates, theirs)}
        results[path.name] = {
            **read, "file_bytes": path.stat().st_size, "kvserve_load_s": load_s,
            "kvserve_tok_s": ours, "llamacpp_tok_s": theirs, "ratio": ratio,
            "round_bandwidth_gbs": round_bandwidth,
            "stream_floor_ms": 1000 / statistics.median(floor_rates),
            **{f"{name}_step_ms": ms for name, ms in step.items()},
            **{f"{name}_vs_stream_floor": r.median for name, r in vs_floor.items()},
            "vs_stream_floor": vs_floor}
        if prompt_tokens:
            results[path.name]["prompt"] = {
                "tokens": prompt_tokens, "kvserve_tok_s": ours_pp, "llamacpp_tok_s": theirs_pp,
                "ratio": paired_ratio(ours_pp, theirs_pp)}
            log(f"{path.name}: pp{prompt_tokens} kvserve / llama.cpp "
                f"{describe_ratio(results[path.name]['prompt']['ratio'])}")
        log(f"{path.name}: kvserve / llama.cpp {describe_ratio(ratio)}; steps "
            f"{step['kvserve']:.1f} / {step['llamacpp']:.1f} ms, "
            f"{vs_floor['kvserve'].median:.2f}x / {vs_floor['llamacpp'].median:.2f}x their "
            "rounds' floors")
    return {"tokens": tokens, "depth": depth, "prompt_tokens": prompt_tokens,
            "rounds": rounds, "threads": threads,
            "engine_args": engine_args, "stream_bandwidth_gbs": statistics.median(bandwidths),
            "llamacpp_build": build, "files": results, "cpus": cpus}


def cmd_gguf_decode(args: argparse.Namespace) -> int:
    """``kvserve bench gguf-decode FILE...``."""
    from kvserve.bench.bench_args import engine_args_from
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report
    from kvserve.worker.platform import physical_cores

    files = [Path(f) for f in args.files]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"kvserve: error: no such GGUF file: {', '.join(missing)}")
    engine_args = engine_args_from(args)
    threads = args.threads or engine_args.get("num_threads") or physical_cores()
    info = _header("kvserve gguf-decode", {"files": [f.name for f in files],
                                           "tokens": args.tokens, "depth": args.depth,
                                           "prompt_tokens": args.prompt_tokens,
                                           "rounds": args.rounds,
                                           "threads": threads, "engine_args": engine_args})
    res = run_gguf_decode(files, args.llama_bench, args.rounds, args.tokens, threads,
                          engine_args, depth=args.depth, prompt_tokens=args.prompt_tokens)
    print(report.format_table(
        ["file", "kvserve tok/s", "llama.cpp tok/s", "kvserve / llama.cpp",
         "kvserve vs floor", "llama.cpp vs floor"],
        [(name, statistics.median(r["kvserve_tok_s"]), statistics.median(r["llamacpp_tok_s"]),
          ratio_cell(r["ratio"]), r["kvserve_vs_stream_floor"], r["llamacpp_vs_stream_floor"])
         for name, r in res["files"].items()]))
    if args.prompt_tokens:
        print(report.format_table(
            ["file", f"pp{args.prompt_tokens} kvserve tok/s", "llama.cpp tok/s",
             "kvserve / llama.cpp"],
            [(name, statistics.median(p["kvserve_tok_s"]), statistics.median(p["llamacpp_tok_s"]),
              ratio_cell(p["ratio"]))
             for name, p in ((n, r["prompt"]) for n, r in res["files"].items())]))
    if args.json:
        out = {"machine": info, "model": args.model_name or files[0].stem, "result": res}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0


def add_gguf_decode_parser(sub: Any) -> None:
    from kvserve.bench.bench_args import add_engine_args, add_output_args

    p = sub.add_parser("gguf-decode", help="one stream's decode on GGUF files against "
                                           "llama-bench on the same files",
                       description="Alternate kvserve and llama.cpp's llama-bench on each "
                                   "GGUF file; report tokens/s, the median of the rounds' "
                                   "ratios, and each against the bytes-read floor.")
    p.add_argument("files", nargs="+", help="GGUF files (kvserve bench make-model --format "
                                            "gguf-...)")
    p.add_argument("--llama-bench", required=True, metavar="PATH",
                   help="llama.cpp's llama-bench binary")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens generated a round (default {DEFAULT_TOKENS})")
    p.add_argument("--depth", type=int, default=0,
                   help="context tokens before the timed steps, as llama-bench's -d: the "
                        "steps then attend to them (default 0)")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="also time one prompt of this many tokens a round, as llama-bench's "
                        "-p N -n 0 (default 0: decode only)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp threads (default: kvserve's, the physical cores)")
    p.add_argument("--model-name", default=None, help="the model's name in the JSON")
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_gguf_decode)
