"""``kvserve bench lora``: a decode step of a batch whose requests use four LoRA
adapters, against the same batch on the base model alone.

One engine (``enable_lora``, four slots) decodes ``--batch`` requests: in the ``base``
arm none names an adapter, in the ``lora`` arm they are spread evenly over four adapters
(each made by peft over the model, rank ``--rank``, on q/k/v/o/gate/up/down), and in the
``lora-torch`` arm the same with the adapters' products on torch's grouped matmuls
instead of the native kernel. Each round times ``--decode-steps`` steps of each arm, in
alternating order; the figures are the medians of the rounds' ratios of step times.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvserve.bench.instruments.paired import describe_ratio, paired_ratio

ARMS = ("base", "lora", "lora-torch")
NUM_ADAPTERS = 4


def make_adapters(model_dir: Path, out: Path, rank: int, count: int = NUM_ADAPTERS
                  ) -> list[Path]:
    """``count`` random rank-``rank`` adapters of ``model_dir``, saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(
            r=rank, lora_alpha=2 * rank, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
        path = out / f"adapter-{i}"
        model.save_pretrained(path)
        paths.append(path)
        del model, base
    return paths


def _decode_step_s(llm: Any, batch: int, prompt_len: int, steps: int, loras: list) -> float:
    """Seconds a decode step of ``batch`` requests takes over ``steps`` steps (request i
    with adapter ``loras[i % len(loras)]``)."""
    from kvserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + 11 * j + 3) % 1000 + 10 for j in range(prompt_len)]
        engine.add_request(f"lora-bench-{i}", {"prompt_token_ids": prompt}, params,
                           lora_request=loras[i % len(loras)])
    while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # the prompts
    start = time.perf_counter()
    done = 0
    while engine.has_unfinished_requests():
        engine.step()
        done += 1
    return (time.perf_counter() - start) / done


def run_lora_bench(model_dir: Path, adapters: list[Path], engine_args: dict[str, Any],
                   rounds: int, batch: int, steps: int, prompt_len: int, rank: int,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    from kvserve import LoRARequest
    from kvserve.bench.instruments.throughput import load_llm

    args = {**engine_args, "enable_lora": True, "max_loras": NUM_ADAPTERS,
            "max_lora_rank": rank, "max_num_seqs": max(batch, engine_args.get(
                "max_num_seqs", 0) or 0)}
    llm = load_llm(model_dir, args)[0]
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    manager = llm.engine.worker.inner.lora
    native = {name: layer.kernels for name, layer in manager.layers.items()}

    def arm(name: str) -> float:
        for layer_name, layer in manager.layers.items():
            layer.kernels = None if name == "lora-torch" else native[layer_name]
        return _decode_step_s(llm, batch, prompt_len, steps,
                              [None] if name == "base" else loras)

    for name in ARMS:  # one untimed pass each: adapters read, caches and kernels warm
        arm(name)
    step_s: dict[str, list[float]] = {k: [] for k in ARMS}
    for r in range(rounds):
        for name in (ARMS if r % 2 == 0 else ARMS[::-1]):
            step_s[name].append(arm(name))
        log(f"  round {r + 1} of {rounds}: " + ", ".join(
            f"{name} {1e3 * step_s[name][-1]:.2f} ms" for name in ARMS) + " a step")
    kernels_native = any(v is not None for v in native.values())
    llm.engine.close()
    return {"rounds": rounds, "batch": batch, "decode_steps": steps, "prompt_len": prompt_len,
            "adapters": len(adapters), "rank": rank, "native_kernel": kernels_native,
            "step_s": step_s,
            "lora_over_base": paired_ratio(step_s["lora"], step_s["base"]),
            "lora_torch_over_base": paired_ratio(step_s["lora-torch"], step_s["base"]),
            "slot_mib": manager.slot_bytes / 2**20}


def cmd_lora(args) -> int:
    """``kvserve bench lora``: decode steps with four adapters against the base alone."""
    from kvserve.bench.bench_args import engine_args_from, resolve_model_dir
    from kvserve.bench.bench_setup import _header
    from kvserve.bench.reports import report

    model_dir = resolve_model_dir(args.model)
    engine_args = engine_args_from(args)
    info = _header("kvserve lora", {"model": model_dir.name, "engine_args": engine_args,
                                    "rounds": args.rounds, "batch": args.batch,
                                    "rank": args.rank, "decode_steps": args.decode_steps})
    with tempfile.TemporaryDirectory(prefix="kvserve-lora-") as tmp:
        adapters = make_adapters(model_dir, Path(tmp), args.rank)
        res = run_lora_bench(model_dir, adapters, engine_args, args.rounds, args.batch,
                             args.decode_steps, args.prompt_len, args.rank)
    median = {k: 1e3 * statistics.median(v) for k, v in res["step_s"].items()}
    print(f"decode step of {res['batch']} requests, median: base {median['base']:.2f} ms, "
          f"{res['adapters']} adapters of rank {res['rank']} {median['lora']:.2f} ms "
          f"(native kernel), {median['lora-torch']:.2f} ms (torch)")
    print(f"adapters over base: {describe_ratio(res['lora_over_base'])}; on torch's path "
          f"{describe_ratio(res['lora_torch_over_base'])}")
    if args.json:
        out = {"machine": info, "model": model_dir.name, "engine_args": engine_args,
               "result": res}
        print(f"wrote {report.write_json(args.json, out)}")
    return 0
