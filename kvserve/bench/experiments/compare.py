"""``kvserve bench compare``: kvserve against its peers on one workload, in one run.

Runs kvserve offline throughput (and any ``--variant``: kvserve again with other
engine settings, e.g. int8 or a float16 KV cache, loaded beside the defaults), HF
static batching and, when asked, vLLM's CPU build in another venv, all in the same
alternating rounds; then HF at its best batch size over a sweep, when asked. Prints a
table of each system's median run, its ratios against HF static batching, vLLM and
kvserve's defaults (the median of the rounds' ratios: kvserve.bench.instruments.paired) and its
share of the machine's float32 GEMM roofline, and writes JSON and a PNG bar chart.
"""

from __future__ import annotations

import functools
import gc
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from kvserve.bench.instruments.cpu_sets import CpuSampler, CpuUsage, check_same_cpus
from kvserve.bench.instruments.decode import DecodeResult, measure_decode
from kvserve.bench.instruments.paired import PairedRatio, paired_ratio
from kvserve.bench.instruments.roofline import MatmulShape, RooflineResult, gemm_peak, \
    workload_flops
from kvserve.bench.instruments.throughput import median_result
from kvserve.bench.reports import report
from kvserve.worker import compute_thread

__all__ = ["PEERS", "run_compare", "compare_rows", "ratio_lines", "parse_against",
           "parse_variant"]

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


def _run_rounds(model_dir: Path, requests: Sequence[Any],
                engines: Sequence[tuple[str, dict[str, Any]]], repeats: int,
                peers: Sequence[_PeerRounds] = (), log: Callable[[str], None] = print,
                watch: dict[str, CpuSampler] | None = None
                ) -> dict[str, tuple[list[Any], DecodeResult]]:
    """Offline throughput runs and single-stream decode of each kvserve engine (name,
    settings): all of them loaded first, then rounds of one run of each in turn, the
    ``peers`` (see _PeerRounds) closing every round; a line per round is logged. The
    engines are released on return. ``watch`` gets each engine's CpuSampler, which
    watches this process during that engine's runs."""
    from kvserve.bench.instruments import throughput

    loaded = [(name, settings, *throughput.load_llm(model_dir, settings))
              for name, settings in engines]
    runs: dict[str, list[Any]] = {name: [] for name, *_ in loaded}
    watch = {} if watch is None else watch
    rounds = max(1, repeats)
    for i in range(rounds):
        parts = []
        for name, settings, llm, load_s in loaded:
            with watch.setdefault(name, CpuSampler()):
                run = throughput.run_throughput(model_dir, requests, settings, llm=llm,
                                                progress=True)
            run.load_s = load_s
            runs[name].append(run)
            parts.append(f"{name} {run.useful_tok_s:.1f} tok/s")
        first = runs[loaded[0][0]][-1].useful_tok_s
        for peer in peers:
            peer.run_round()
            done = peer.runs[-1]
            if done is not None and done.useful_tok_s > 0:
                parts.append(f"{peer.name} {done.useful_tok_s:.1f} tok/s "
                             f"({first / done.useful_tok_s:.2f}x)")
        log(f"  round {i + 1} of {rounds}: " + ", ".join(parts))
    prompt = list(requests[0].prompt_token_ids[:16])
    return {name: (runs[name], measure_decode(llm, prompt)) for name, _, llm, _ in loaded}


class _PeerRounds:
    """A loaded peer (HF static batching, a VllmSession) run once a round, after
    kvserve's runs: rounds of kvserve then its peers, so that the machine's drift over
    the rounds falls on all alike. ``runs`` holds one entry a round, None where the peer
    did not complete it: a failed run ends its rounds, with a note, and the rounds
    before it stay."""

    def __init__(self, name: str, run: Callable[[], Any], close: Callable[[], None],
                 notes: list[str], cpu_usage: Callable[[], CpuUsage | None],
                 build: dict[str, Any]) -> None:
        """``cpu_usage``: the CPUs its runs used (watched by whoever runs it); ``build``:
        its version and settings, as recorded in the results."""
        self.name, self._run, self._close, self.notes = name, run, close, notes
        self.cpu_usage, self.build = cpu_usage, build
        self.runs: list[Any | None] = []

    def run_round(self) -> None:
        if self._run is None:
            self.runs.append(None)
            return
        try:
            self.runs.append(self._run())
        except RuntimeError as exc:
            self.notes.append(f"{self.name} failed in round {len(self.runs) + 1}, its later "
                              f"rounds not run: {str(exc)[-500:]}")
            self.runs.append(None)
            self.close()

    @property
    def completed(self) -> list[Any]:
        return [run for run in self.runs if run is not None]

    def close(self) -> None:
        if self._run is not None:
            self._run = None
            self._close()


def _vllm_peer(vllm_python: str | None, model_dir: Path, requests: Sequence[Any],
               kv_cache_gib: float, dtype: str, log: Callable[[str], None], notes: list[str]
               ) -> _PeerRounds | None:
    """vLLM CPU loaded in its own interpreter (a VllmSession) as a peer, or None with a
    note when it is not installed or fails to start."""
    from kvserve.bench.peers import vllm_runner

    if not vllm_python:
        notes.append("vllm-cpu skipped: no --vllm-python given")
        return None
    if not vllm_runner.vllm_importable(vllm_python):
        notes.append(f"vllm-cpu skipped: {vllm_python} cannot import vllm")
        return None
    log("starting vLLM CPU in a subprocess ...")
    try:
        session = vllm_runner.VllmSession(vllm_python, model_dir, requests,
                                          kv_cache_gib=kv_cache_gib,
                                          engine_args={"dtype": dtype})
    except RuntimeError as exc:
        notes.append(f"vllm-cpu failed: {str(exc)[-500:]}")
        return None
    return _PeerRounds("vllm-cpu", session.run, session.close, notes,
                       lambda: session.cpu_sampler.usage, session.build)


def _hf_peer(model_dir: Path, requests: Sequence[Any], batch_size: int, threads: int | None,
             notes: list[str]) -> tuple[_PeerRounds, Any]:
    """HF static batching in this process as a peer, and its model (for the sweep)."""
    from kvserve.bench.peers import hf_baseline

    model = hf_baseline.load_hf_model(model_dir)
    watch = CpuSampler()

    def run() -> Any:  # on the engines' compute thread: one OpenMP team in the process
        with watch:
            return compute_thread().call(hf_baseline.run_hf_static, model, requests,
                                         batch_size, threads=threads)
    build = {"transformers_version": report.machine_info()["transformers_version"],
             "batch_size": batch_size, "threads": threads, "dtype": "float32",
             "process": "the bench's own, on kvserve's compute thread"}
    return _PeerRounds(f"hf-static-{batch_size}", run, lambda: None, notes,
                       lambda: watch.usage, build), model


def _model_shape(model_dir: Path) -> MatmulShape:
    return MatmulShape.from_config(json.loads((model_dir / "config.json").read_text()))


# The ratio columns: each row's useful tok/s over the reference's, paired by round.
RATIO_REFERENCES = ("vs_hf_static", "vs_vllm", "vs_kvserve")


def compare_rows(
    results: Sequence[tuple[str, Any]],
    round_rates: dict[str, Sequence[float | None]],
    baseline: str | None,
    flops: float,
    peak_gflops: float,
    quantized: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Table rows: the median run's rates; ``vs_hf_static``, ``vs_vllm`` and
    ``vs_kvserve``, the paired ratio (kvserve.bench.instruments.paired) of the row's useful tok/s
    over ``baseline``'s, vLLM's and kvserve's defaults', for the systems that ran in the
    same rounds (``round_rates``: useful tok/s by round, None where a run failed); the
    share of the float32 GEMM roofline (none for the ``quantized`` rows: their GEMMs are
    int8 or 16-bit)."""
    references = dict(zip(RATIO_REFERENCES, (baseline, "vllm-cpu", "kvserve")))

    def ratio(name: str, reference: str | None) -> PairedRatio | None:
        if name not in round_rates or reference not in round_rates:
            return None
        return paired_ratio(round_rates[name], round_rates[reference])

    rows = []
    for name, res in results:
        rows.append({
            "name": name,
            "wall_s": res.wall_s,
            "useful_tok_s": res.useful_tok_s,
            "total_tok_s": res.total_tok_s,
            "requests_per_s": res.num_requests / res.wall_s if res.wall_s > 0 else 0.0,
            **{key: ratio(name, ref) for key, ref in references.items()},
            "roofline_share": (flops / res.wall_s / (peak_gflops * 1e9))
            if peak_gflops > 0 and res.wall_s > 0 and name not in quantized
            else None,
        })
    return rows


def ratio_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """kvserve's defaults against HF and vLLM, each variant in their rounds against the
    defaults: ``kvserve / vLLM: 1.23x (median of 3 rounds' ratios; 1.18–1.31)``."""
    labels = {"vs_hf_static": "HF static", "vs_vllm": "vLLM", "vs_kvserve": "kvserve"}
    return [f"{row['name']} / {labels[key]}: {row[key].describe()}" for row in rows
            for key in (("vs_hf_static", "vs_vllm") if row["name"] == "kvserve" else
                        ("vs_kvserve",) if row["name"].startswith("kvserve ") else ())
            if row[key] is not None]


def _table_order(item: tuple[str, Any]) -> int:
    """kvserve's rows first, then HF's, vLLM's last."""
    return 0 if item[0].startswith("kvserve") else 2 if item[0] == "vllm-cpu" else 1


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
    vllm_dtype: str = "float32",
    roofline: RooflineResult | None = None,
    remeasure_roofline: Callable[[], RooflineResult] | None = None,
    repeats: int = 1,
    log: Callable[[str], None] = print,
    variants: Sequence[tuple[str, dict[str, Any]]] = (),
) -> dict[str, Any]:
    """Run every system on ``requests``; returns rows, raw results and notes.
    ``variants``: (label, engine settings over ``engine_args``) run as "kvserve label".
    ``remeasure_roofline``: measures the ceilings again after the runs; the roofline
    share divides by the best GEMM rate of both measurements (gemm_peak)."""
    from kvserve.bench.peers import hf_baseline

    model_dir = Path(model_dir)
    engine_args = dict(engine_args or {})
    results: list[tuple[str, Any]] = []
    round_rates: dict[str, list[float | None]] = {}
    raw: dict[str, Any] = {}
    notes: list[str] = []

    quantized: list[str] = []
    watch: dict[str, CpuSampler] = {}  # kvserve engines' CPUs
    peer_cpus: dict[str, CpuUsage | None] = {}
    builds: dict[str, dict[str, Any]] = {}
    decode = None
    variant_decodes: dict[str, DecodeResult] = {}
    # kvserve's defaults, the variants, HF and vLLM run in alternating rounds: the
    # machine drifts by several percent over minutes, and every ratio is taken round by
    # round (kvserve.bench.instruments.paired). A variant that changes the whole process runs alone
    # after them, with no ratio.
    alone = [v for v in variants if PROCESS_WIDE_SETTINGS & set(v[1])]
    groups = [[("", {}), *(v for v in variants if v not in alone)], *([v] for v in alone)]
    hf_name = f"hf-static-{hf_batch_size}" if "hf" in against else None
    for index, group in enumerate(groups):
        engines = [(f"kvserve {label}".strip(), {**engine_args, **overrides})
                   for label, overrides in group]
        peers: list[_PeerRounds] = []
        hf_model = hf_peer = None
        if index == 0 and hf_name:
            log(f"loading HF transformers for static batching (batch {hf_batch_size}) ...")
            hf_peer, hf_model = _hf_peer(model_dir, requests, hf_batch_size, hf_threads, notes)
            peers.append(hf_peer)
        if index == 0 and "vllm-cpu" in against:
            vllm = _vllm_peer(vllm_python, model_dir, requests, vllm_kv_cache_gib, vllm_dtype,
                              log, notes)
            peers += [vllm] if vllm else []
        log("running " + ", ".join(f"{name} {overrides}" if overrides else name
                                   for (name, _), (_, overrides) in zip(engines, group))
            + (f" (rounds with {', '.join(p.name for p in peers)}) ..." if peers else " ..."))
        try:
            measured = _run_rounds(model_dir, requests, engines, repeats, peers, log, watch)
        finally:
            for peer in peers:
                peer.close()
        gc.collect()
        for (name, settings), (_, overrides) in zip(engines, group):
            runs, row_decode = measured[name]
            res, rates = median_result(runs)
            results.append((name, res))
            raw[name] = {**res.to_dict(), "repeat_useful_tok_s": rates}
            if index == 0:
                round_rates[name] = rates
            if settings.get("quantization") or settings.get("dtype") in ("bfloat16", "float16"):
                quantized.append(name)  # not float32 GEMMs: the float32 roofline does not apply
            if not overrides:
                decode = row_decode
                continue
            raw[name]["engine_args"] = settings
            variant_decodes[name] = row_decode
            raw[name]["alone"] = index > 0
            if index > 0:
                process_wide = ", ".join(sorted(PROCESS_WIDE_SETTINGS & set(overrides)))
                notes.append(f"{name} ran alone after the others ({process_wide}: "
                             "process-wide), so it has no ratio")
        for peer in peers:
            peer_cpus[peer.name], builds[peer.name] = peer.cpu_usage(), peer.build
            if peer.completed:
                res, rates = median_result(peer.completed)
                results.append((peer.name, res))
                raw[peer.name] = {**res.to_dict(), "repeat_useful_tok_s": rates}
                round_rates[peer.name] = [r.useful_tok_s if r else None for r in peer.runs]
        sweep = [b for b in hf_sweep if b != hf_batch_size]
        if hf_peer is not None and sweep and hf_peer.completed:
            log(f"running HF static batching sweep {list(hf_sweep)} (not in the rounds) ...")
            _, all_res = compute_thread().call(hf_baseline.sweep_hf_static, hf_model, requests,
                                               sweep, warmup=False, threads=hf_threads)
            all_res.append(dict(results)[hf_name])
            best = max(all_res, key=lambda r: r.useful_tok_s)
            results.append((f"hf-best-{best.batch_size}", best))
            raw["hf_sweep"] = {str(r.batch_size): r.useful_tok_s for r in all_res}
        del hf_model
        gc.collect()

    results.sort(key=_table_order)
    measurements = [roofline] if roofline is not None else []
    if remeasure_roofline is not None:
        log("measuring roofline again ...")
        measurements.append(remeasure_roofline())
    ceilings = functools.reduce(RooflineResult.best_of, measurements) if measurements else None
    for name, row_decode in variant_decodes.items():
        raw[name]["decode"] = decode_figures(row_decode, ceilings)
    shape = _model_shape(model_dir)
    flops = workload_flops([(r.prompt_len, r.max_tokens) for r in requests], shape)
    peak = gemm_peak(measurements)
    peak_gflops = peak.gflops if peak is not None else 0.0
    rows = compare_rows(results, round_rates, hf_name, flops, peak_gflops, quantized)
    cpus = {**{name: w.usage for name, w in watch.items()}, **peer_cpus}
    # the systems in processes of their own against kvserve's defaults; kvserve's variants
    # and HF share this process and its compute thread's team by construction
    check_same_cpus({"kvserve": cpus.get("kvserve"),
                     **{name: cpus[name] for name in peer_cpus if name != hf_name}})
    return {
        "rows": rows,
        "decode": decode_figures(decode, ceilings),
        "results": raw,
        "notes": notes,
        "workload_flops": flops,
        "matmul_params": shape.params,
        "gemm_peak": peak,
        "gemm_bound_s": flops / (peak_gflops * 1e9) if peak_gflops > 0 else None,
        "roofline": ceilings.to_dict() if ceilings is not None else None,
        "roofline_measurements": [m.to_dict() for m in measurements],
        "peers": builds,
        "cpus": {name: usage.to_dict() if usage is not None else None
                 for name, usage in cpus.items()},
    }
