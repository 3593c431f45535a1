"""``kvserve bench compare``: kvserve against its peers on one workload, in one run.

Runs kvserve offline throughput (and any ``--variant``: kvserve again with other
engine settings, e.g. int8 or a float16 KV cache, loaded beside the defaults and run in
the same rounds), the HF static-batching baseline (and, when asked, HF at its best
batch size over a sweep and vLLM's CPU build in another venv, its runs in the same
rounds as kvserve's), then prints a
table of ratios against HF static batching and vLLM and each system's share of the
machine's float32 GEMM roofline, and writes JSON and a PNG bar chart.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.decode import DecodeResult, measure_decode
from kvserve.bench.roofline import RooflineResult, matmul_params, workload_flops
from kvserve.bench.throughput import median_result

__all__ = ["PEERS", "run_compare", "compare_rows", "parse_against", "parse_variant"]

PEERS: tuple[str, ...] = ("hf", "vllm-cpu", "llamacpp")  # llamacpp: single stream


def parse_against(text: str) -> list[str]:
    """``"hf,vllm-cpu"`` -> ``["hf", "vllm-cpu"]`` (validated)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    return names


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``"int8:quantization=int8,kv_cache_dtype=float16"`` -> ``("int8", {...})``."""
    from kvserve.bench.bench_args import parse_value

    label, sep, settings = text.partition(":")
    pairs = [item.partition("=") for item in settings.split(",") if item.strip()]
    if not sep or not label.strip() or not pairs or any(not k.strip() or not eq
                                                        for k, eq, _ in pairs):
        raise ValueError(f"--variant wants LABEL:KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return label.strip(), {k.strip().replace("-", "_"): parse_value(v.strip())
                           for k, _, v in pairs}


def decode_figures(decode: DecodeResult, roofline: RooflineResult | None) -> dict[str, Any]:
    """A single-stream decode result with its bandwidth floors when the roofline is known."""
    info = decode.to_dict()
    if roofline is not None:
        info["gemv_floor_s"] = decode.weight_bytes / (roofline.gemv_bandwidth_gbs * 1e9)
        info["vs_gemv_floor"] = decode.vs_floor(roofline.gemv_bandwidth_gbs)
        info["stream_floor_s"] = decode.weight_bytes / (roofline.sum_bandwidth_gbs * 1e9)
        info["vs_stream_floor"] = decode.vs_floor(roofline.sum_bandwidth_gbs)
    return info


# Settings that change the whole process (torch's thread count and binding, a model
# thread's OpenMP team): a variant that sets one is not loaded beside the defaults.
PROCESS_WIDE_SETTINGS = frozenset({"num_threads", "omp_threads_bind", "async_scheduling",
                                   "tensor_parallel_size"})


def _run_kvserve(model_dir: Path, requests: Sequence[Any],
                 engines: Sequence[tuple[str, dict[str, Any]]], repeats: int,
                 between: _PeerRounds | None = None, log: Callable[[str], None] = print
                 ) -> dict[str, tuple[list[Any], DecodeResult]]:
    """Offline throughput runs and single-stream decode of each engine (name, settings):
    all of them loaded first, then rounds of one run of each in turn, ``between`` (a
    peer's run: see _PeerRounds) closing every round; a line per round is logged. The
    engines are released on return."""
    from kvserve.bench import throughput

    loaded = [(name, settings, *throughput.load_llm(model_dir, settings))
              for name, settings in engines]
    runs: dict[str, list[Any]] = {name: [] for name, *_ in loaded}
    rounds = max(1, repeats)
    for i in range(rounds):
        parts = []
        for name, settings, llm, load_s in loaded:
            run = throughput.run_throughput(model_dir, requests, settings, llm=llm,
                                            progress=True)
            run.load_s = load_s
            runs[name].append(run)
            parts.append(f"{name} {run.useful_tok_s:.1f} tok/s")
        first = runs[loaded[0][0]][-1].useful_tok_s
        if between is not None:
            between()
            if between.runs and len(between.runs) == i + 1:
                peer = between.runs[-1].useful_tok_s
                parts.append(f"vllm-cpu {peer:.1f} tok/s ({first / peer:.2f}x)")
        log(f"  round {i + 1} of {rounds}: " + ", ".join(parts))
    prompt = list(requests[0].prompt_token_ids[:16])
    return {name: (runs[name], measure_decode(llm, prompt)) for name, _, llm, _ in loaded}


class _PeerRounds:
    """A loaded peer (VllmSession) run once each call, between kvserve's runs: rounds of
    kvserve then peer, so that the machine's drift over the rounds falls on both alike.
    A failed run ends the rounds, with a note, and drops the peer's results."""

    def __init__(self, session: Any, notes: list[str]) -> None:
        self.session, self.notes, self.runs = session, notes, []

    def __call__(self) -> None:
        if self.session is None:
            return
        try:
            self.runs.append(self.session.run())
        except RuntimeError as exc:
            self.notes.append(f"vllm-cpu failed: {str(exc)[-500:]}")
            self.runs = []
            self.close()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _start_vllm(vllm_python: str | None, model_dir: Path, requests: Sequence[Any],
                kv_cache_gib: float, log: Callable[[str], None], notes: list[str]) -> Any:
    """vLLM CPU loaded in its own interpreter (a VllmSession), or None with a note when
    it is not installed or fails to start."""
    from kvserve.bench import vllm_runner

    if not vllm_python:
        notes.append("vllm-cpu skipped: no --vllm-python given")
        return None
    if not vllm_runner.vllm_importable(vllm_python):
        notes.append(f"vllm-cpu skipped: {vllm_python} cannot import vllm")
        return None
    log("starting vLLM CPU in a subprocess ...")
    try:
        return vllm_runner.VllmSession(vllm_python, model_dir, requests,
                                       kv_cache_gib=kv_cache_gib)
    except RuntimeError as exc:
        notes.append(f"vllm-cpu failed: {str(exc)[-500:]}")
        return None


def _median_run(run: Callable[[], Any], repeats: int) -> tuple[Any, list[float]]:
    """Run ``repeats`` times; the result with the median useful tok/s, and all rates."""
    return median_result([run() for _ in range(max(1, repeats))])


def _model_shape(model_dir: Path) -> tuple[int, int, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return matmul_params(cfg), int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])


def compare_rows(
    results: Sequence[tuple[str, Any]],
    baseline: str | None,
    flops: float,
    peak_gflops: float,
    quantized: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Table rows: rates, ratios against ``baseline``'s and vLLM's useful tok/s, share of
    the float32 GEMM roofline (none for the ``quantized`` rows: their GEMMs are int8 or
    16-bit)."""
    base = dict(results).get(baseline) if baseline else None
    vllm = dict(results).get("vllm-cpu")
    rows = []
    for name, res in results:
        row = {
            "name": name,
            "wall_s": res.wall_s,
            "useful_tok_s": res.useful_tok_s,
            "total_tok_s": res.total_tok_s,
            "requests_per_s": res.num_requests / res.wall_s if res.wall_s > 0 else 0.0,
            "vs_hf_static": (res.useful_tok_s / base.useful_tok_s) if base and base.useful_tok_s else None,
            "vs_vllm": (res.useful_tok_s / vllm.useful_tok_s) if vllm and vllm.useful_tok_s else None,
            "roofline_share": (flops / res.wall_s / (peak_gflops * 1e9))
            if peak_gflops > 0 and res.wall_s > 0 and name not in quantized
            else None,
        }
        rows.append(row)
    return rows


def run_compare(
    model_dir: str | Path,
    requests: Sequence[Any],
    against: Sequence[str] = ("hf",),
    engine_args: dict[str, Any] | None = None,
    hf_batch_size: int = 16,
    hf_sweep: Sequence[int] = (),
    hf_threads: int | None = 2,
    vllm_python: str | None = None,
    vllm_kv_cache_gib: float = 4.0,
    roofline: RooflineResult | None = None,
    remeasure_roofline: Callable[[], RooflineResult] | None = None,
    repeats: int = 1,
    log: Callable[[str], None] = print,
    variants: Sequence[tuple[str, dict[str, Any]]] = (),
) -> dict[str, Any]:
    """Run every system on ``requests``; returns rows, raw results and notes.
    ``variants``: (label, engine settings over ``engine_args``) run as "kvserve label".
    ``remeasure_roofline``: measures the ceilings again after the runs; each ceiling is
    then the higher of the two measurements (see RooflineResult.best_of)."""
    from kvserve.bench import hf_baseline

    model_dir = Path(model_dir)
    engine_args = dict(engine_args or {})
    results: list[tuple[str, Any]] = []
    raw: dict[str, Any] = {}
    notes: list[str] = []

    quantized: list[str] = []
    decode = None
    variant_decodes: dict[str, DecodeResult] = {}
    # kvserve's defaults, the variants and vLLM run in alternating rounds, before HF: the
    # machine drifts by several percent over minutes, and the ratios between these are
    # the ones a few percent decide. A variant that changes the whole process runs alone
    # after them.
    alone = [v for v in variants if PROCESS_WIDE_SETTINGS & set(v[1])]
    groups = [[("", {}), *(v for v in variants if v not in alone)], *([v] for v in alone)]
    for group in groups:
        engines = [(f"kvserve {label}".strip(), {**engine_args, **overrides})
                   for label, overrides in group]
        with_vllm = not group[0][1] and "vllm-cpu" in against
        peer = _PeerRounds(_start_vllm(vllm_python, model_dir, requests, vllm_kv_cache_gib,
                                       log, notes) if with_vllm else None, notes)
        log("running " + ", ".join(f"{name} {overrides}" if overrides else name
                                   for (name, _), (_, overrides) in zip(engines, group))
            + (" (rounds with vLLM) ..." if peer.session else " ..."))
        try:
            measured = _run_kvserve(model_dir, requests, engines, repeats, peer, log)
        finally:
            peer.close()
        gc.collect()
        base_rates = [r.useful_tok_s for r in measured[engines[0][0]][0]]
        for (name, settings), (_, overrides) in zip(engines, group):
            runs, row_decode = measured[name]
            res, rates = median_result(runs)
            results.append((name, res))
            raw[name] = {**res.to_dict(), "repeat_useful_tok_s": rates}
            if settings.get("quantization") or settings.get("dtype") in ("bfloat16", "float16"):
                quantized.append(name)  # not float32 GEMMs: the float32 roofline does not apply
            if not overrides:
                decode = row_decode
                continue
            raw[name]["engine_args"] = settings
            variant_decodes[name] = row_decode
            raw[name]["alone"] = len(group) == 1
            if len(group) > 1:  # in the defaults' rounds: their ratio round by round
                raw[name]["round_ratios_vs_kvserve"] = [v / b for v, b in zip(rates, base_rates)]
        if peer.runs:
            vl, vl_rates = median_result(peer.runs)
            results.append(("vllm-cpu", vl))
            raw["vllm-cpu"] = {**vl.to_dict(), "repeat_useful_tok_s": vl_rates,
                               "round_ratios": [a / b for a, b in zip(base_rates, vl_rates)]}

    hf_name = None
    if "hf" in against:
        log(f"running HF static batching (batch {hf_batch_size}) ...")
        model = hf_baseline.load_hf_model(model_dir, threads=hf_threads)
        def hf_run():
            res = hf_baseline.run_hf_static(model, requests, hf_batch_size)
            log(f"  HF run: {res.useful_tok_s:.1f} tok/s")
            return res
        hf, hf_rates = _median_run(hf_run, repeats)
        hf_name = f"hf-static-{hf_batch_size}"
        results.append((hf_name, hf))
        raw[hf_name] = {**hf.to_dict(), "repeat_useful_tok_s": hf_rates}
        sweep = [b for b in hf_sweep if b != hf_batch_size]
        if sweep:
            log(f"running HF static batching sweep {list(hf_sweep)} ...")
            _, all_res = hf_baseline.sweep_hf_static(model, requests, sweep, warmup=False)
            all_res.append(hf)
            best = max(all_res, key=lambda r: r.useful_tok_s)
            results.append((f"hf-best-{best.batch_size}", best))
            raw["hf_sweep"] = {str(r.batch_size): r.useful_tok_s for r in all_res}
        del model
        gc.collect()

    results.sort(key=lambda item: item[0] == "vllm-cpu")  # shown last, as before
    if remeasure_roofline is not None:
        log("measuring roofline again ...")
        again = remeasure_roofline()
        roofline = again if roofline is None else roofline.best_of(again)
    for name, row_decode in variant_decodes.items():
        raw[name]["decode"] = decode_figures(row_decode, roofline)
    params, layers, hidden = _model_shape(model_dir)
    flops = workload_flops([(r.prompt_len, r.max_tokens) for r in requests], params, layers, hidden)
    peak = roofline.peak_gflops if roofline is not None else 0.0
    rows = compare_rows(results, hf_name, flops, peak, quantized)
    return {
        "rows": rows,
        "decode": decode_figures(decode, roofline),
        "results": raw,
        "notes": notes,
        "workload_flops": flops,
        "matmul_params": params,
        "gemm_bound_s": flops / (peak * 1e9) if peak > 0 else None,
        "roofline": roofline.to_dict() if roofline is not None else None,
    }
