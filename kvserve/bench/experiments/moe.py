"""``kvserve bench moe``: a mixture-of-experts model's batch-1 decode against a dense model
of the same total size.

At one token a step, a MoE layer runs only the experts its router chose, so a decode step
reads the attention weights, the router, ``experts_per_tok`` of the experts and the
output head: a fraction of the model. The dense peer (``--dense``, or one built here) has
the MoE model's shape with one MLP as wide as all its experts together, so both hold the
same weights' bytes. Each round decodes ``--decode-steps`` tokens of one request on each
model, in alternating order; the figure is the median of the rounds' ratios of their
step times. Beside it: the weight bytes each step reads (counted from the shapes and the
experts the MoE layers actually ran, which the model counts) and the bandwidth that
implies.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvserve.bench.instruments.paired import describe_ratio, paired_ratio

MODELS = ("moe", "dense")


def dense_peer(moe_dir: Path, out: Path) -> Path:
    """A Llama model with the MoE model's attention and one MLP as wide as its experts."""
    from kvserve.bench.workloads.models import BenchModelSpec, make_bench_model
    from kvserve.model.registry import read_arch_config

    a = read_arch_config(moe_dir)
    spec = BenchModelSpec(a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads,
                          a.num_experts * a.moe_intermediate_size, vocab_size=a.vocab_size,
                          max_position_embeddings=a.max_position_embeddings)
    return make_bench_model(spec, out, tokenizer_dir=moe_dir)


def weight_bytes(arch: Any, element_size: int) -> dict[str, int]:
    """Bytes of a model's matmul weights (the layers' and the output head's, from its
    shape): all of them, and its routed experts' (``experts``)."""
    h = arch.hidden_size
    attention = h * arch.head_dim * (2 * arch.num_heads + 2 * arch.num_kv_heads)
    dense = 3 * h * arch.intermediate_size
    experts = 0
    layers = 0
    for i in range(arch.num_layers):
        if arch.num_experts and i not in arch.dense_layers:
            routed = arch.num_experts * 3 * h * arch.moe_intermediate_size
            shared = 3 * h * arch.shared_expert_intermediate_size + h if \
                arch.shared_expert_intermediate_size else 0
            layers += attention + h * arch.num_experts + routed + shared
            experts += routed
        else:
            layers += attention + dense
    total = layers + arch.vocab_size * h
    return {"total": total * element_size, "experts": experts * element_size}


def _decode_step_s(llm: Any, prompt: list[int], steps: int, moes: list
                   ) -> tuple[float, int, int]:
    """(seconds a decode step of one request takes over ``steps`` steps, experts the MoE
    layers ran in them, tokens they routed)."""
    from kvserve import SamplingParams

    engine = llm.engine
    engine.add_request("moe-bench", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prompt, and the first token
    calls, routed = (sum(m.expert_calls for m in moes), sum(m.tokens_routed for m in moes))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    return (seconds, sum(m.expert_calls for m in moes) - calls,
            sum(m.tokens_routed for m in moes) - routed)


def run_moe_bench(moe_dir: Path, dense_dir: Path, engine_args: dict[str, Any], rounds: int,
                  steps: int, prompt_len: int, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    from kvserve.bench.instruments.throughput import load_llm
    from kvserve.model.moe import SparseMoE

    llms = {"moe": load_llm(moe_dir, engine_args)[0], "dense": load_llm(dense_dir,
                                                                       engine_args)[0]}
    models = {k: llm.engine.worker.inner.model for k, llm in llms.items()}
    moes = [m for m in models["moe"].modules() if isinstance(m, SparseMoE)]
    if not moes:
        raise ValueError(f"{moe_dir.name} has no mixture-of-experts layers")
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(prompt_len)]
    step_s: dict[str, list[float]] = {k: [] for k in MODELS}
    for k in MODELS:  # one untimed pass each: caches and kernels as in the rounds
        _decode_step_s(llms[k], prompt, 4, [])
    calls = routed = 0  # experts the MoE layers ran in the decode steps, tokens routed
    for r in range(rounds):
        for k in (MODELS if r % 2 == 0 else MODELS[::-1]):
            seconds, ran, tokens = _decode_step_s(llms[k], prompt, steps,
                                                  moes if k == "moe" else [])
            step_s[k].append(seconds)
            calls, routed = calls + ran, routed + tokens
        log(f"  round {r + 1} of {rounds}: MoE {1e3 * step_s['moe'][-1]:.2f} ms a step, "
            f"dense {1e3 * step_s['dense'][-1]:.2f} ms")
    size = {k: llm.engine.config.model.dtype.itemsize for k, llm in llms.items()}
    moe_bytes = weight_bytes(llms["moe"].engine.config.model.arch, size["moe"])
    dense_bytes = weight_bytes(llms["dense"].engine.config.model.arch, size["dense"])
    top_k, num_experts = moes[0].top_k, moes[0].num_experts
    read = {"moe": moe_bytes["total"] - moe_bytes["experts"] * (1 - top_k / num_experts),
            "dense": dense_bytes["total"]}
    median = {k: statistics.median(v) for k, v in step_s.items()}
    for llm in llms.values():
        llm.engine.close()
    return {
        "rounds": rounds, "decode_steps": steps, "prompt_len": prompt_len,
        "step_s": step_s, "dense_over_moe": paired_ratio(step_s["dense"], step_s["moe"]),
        "num_experts": num_experts, "experts_per_tok": top_k,
        "experts_run_per_routed_token": calls / routed if routed else None,
        "weight_bytes": {"moe": moe_bytes["total"], "dense": dense_bytes["total"]},
        "bytes_read_per_token": read,
        "read_gb_s": {k: read[k] / median[k] / 1e9 for k in MODELS}}


def cmd_moe(args) -> int:
    """``kvserve bench moe``: MoE batch-1 decode vs a dense model of the same size."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report

    moe_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    info = _header("kvserve moe", {"model": moe_dir.name, "dense": args.dense or "built here",
                                   "engine_args": engine_args, "rounds": args.rounds,
                                   "decode_steps": args.decode_steps})
    with tempfile.TemporaryDirectory(prefix="kvserve-dense-") as tmp:
        dense_dir = Path(args.dense) if args.dense else dense_peer(moe_dir, Path(tmp) / "dense")
        try:
            res = run_moe_bench(moe_dir, dense_dir, engine_args, args.rounds,
                                args.decode_steps, args.prompt_len)
        except ValueError as exc:
            raise SystemExit(f"kvserve: error: {exc}") from None
    mib = {k: v / 2**20 for k, v in res["bytes_read_per_token"].items()}
    print(f"weights: MoE {res['weight_bytes']['moe'] / 2**20:.0f} MiB, dense "
          f"{res['weight_bytes']['dense'] / 2**20:.0f} MiB; read a decode step: MoE "
          f"{mib['moe']:.0f} MiB ({res['experts_per_tok']} of {res['num_experts']} experts; "
          f"{res['experts_run_per_routed_token']:.2f} run per routed token), dense "
          f"{mib['dense']:.0f} MiB")
    print(f"decode step, median: MoE {1e3 * statistics.median(res['step_s']['moe']):.2f} ms "
          f"({res['read_gb_s']['moe']:.1f} GB/s), dense "
          f"{1e3 * statistics.median(res['step_s']['dense']):.2f} ms "
          f"({res['read_gb_s']['dense']:.1f} GB/s); dense over MoE "
          f"{describe_ratio(res['dense_over_moe'])}")
    if args.json:
        out = {"machine": info, "model": moe_dir.name, "engine_args": engine_args,
               "result": res}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0
