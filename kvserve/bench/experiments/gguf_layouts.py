"""``kvserve bench gguf-layouts``: the GGUF kernels on a weight as the file stores it
against the same weight in runs of rows (``kernels/gguf_runs.h``), in alternating rounds.

For each block format the runs take (Q4_K, Q5_K, Q6_K, Q8_0), a weight of random blocks
of the 1B shapes' 2048 x 2048 is multiplied by activation rows rounded to int8 (the
engine's default), once in the file's layout and once in runs: 1, 4 and 256 rows (a
single stream's step, a few streams', a prompt chunk) with the weight in cache, and 1
row from memory (copies of the weight making ``MEMORY_BYTES``, each call reading the next,
on huge pages where the kernel offers them, as the engine keeps its weights). Each round
times every case in both layouts back to back, in alternating order; a case's time in a
round is the best of a few batches of calls. The figure is the file layout's time over
the runs', the median of the rounds' ratios (kvserve.bench.instruments.paired).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from kvserve.bench.instruments.paired import paired_ratio

FORMATS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
SHAPE = (2048, 2048)  # weight rows, values a row
CASES = ((1, "cache"), (4, "cache"), (256, "cache"), (1, "memory"))
MEMORY_BYTES = 256 << 20
BATCH_S = 0.02  # the least time a batch of calls is timed over
BATCHES = 3


def _case_name(rows: int, where: str) -> str:
    return f"{rows} {'row' if rows == 1 else 'rows'}, {where}"


def _weights(kernels, kind: str, where: str, shape: tuple[int, int], memory_bytes: int):
    """{layout: [weights]} of random blocks: one copy in cache, enough copies to make
    memory_bytes from memory (huge pages where offered)."""
    import torch

    from kvserve.model.gguf.linear import FORMAT_CODES, IN_RUNS
    from kvserve.model.gguf.quants import BLOCKS, random_blocks
    from kvserve.worker.huge_pages import huge_page_zeros, huge_pages_available

    n, k = shape
    blocks = torch.from_numpy(random_blocks(kind, n * k // BLOCKS[kind][0], seed=0)).reshape(n, -1)
    runs = kernels.gguf_repack_runs(blocks, kind, k)
    if runs is None:
        raise ValueError(f"this build of the kernels has no runs of rows for {kind} "
                         "(they need AVX2)")
    copies = 1 if where == "cache" else max(2, -(-memory_bytes // blocks.numel()))

    def placed(t):
        if not huge_pages_available():
            return t.clone()
        out = huge_page_zeros(tuple(t.shape), t.dtype)
        return out.copy_(t)

    return {"file": (FORMAT_CODES[kind], [placed(blocks) for _ in range(copies)]),
            "runs": (FORMAT_CODES[IN_RUNS[kind]], [placed(runs) for _ in range(copies)])}


def _call_s(kernels, x, code: int, weights, out) -> float:
    """Seconds a call, the best of BATCHES batches of calls lasting BATCH_S or more."""
    best = float("inf")
    for _ in range(BATCHES):
        calls, start = 0, time.perf_counter()
        while True:
            kernels.gguf_rows_int8(x, weights[calls % len(weights)], code, out)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= BATCH_S and calls >= len(weights):
                break
        best = min(best, elapsed / calls)
    return best


def run_paired_variants(rounds: int, variants: dict[str, tuple[Any, str]], formats=FORMATS,
                        shape: tuple[int, int] = SHAPE, cases=CASES,
                        memory_bytes: int = MEMORY_BYTES,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Two variants of the int8 GGUF kernels, {name: (kernels, layout)} (layout "file" or
    "runs"; the baseline first), timed on every case in alternating rounds. Per format
    and case: each variant's GMAC/s a round and the baseline's time over the other's."""
    import torch

    from kvserve.kernels import load_kernels

    kernels = load_kernels()
    if not kernels.available:
        raise ValueError("the native kernels are not built here: there is nothing to compare")
    (base, _), (other, _) = variants.items()
    n, k = shape
    times = {f: {c: {v: [] for v in variants} for c in cases} for f in formats}
    weights = {f: {where: _weights(kernels, f, where, shape, memory_bytes)
                   for where in {w for _, w in cases}} for f in formats}
    for f in formats:  # the same sums either way, to float rounding (of the largest)
        x = torch.randn(max(rows for rows, _ in cases), k)
        outs = {}
        for v, (built, layout) in variants.items():
            code, ws = weights[f]["cache"][layout]
            outs[v] = torch.empty(x.shape[0], n)
            if not built.gguf_rows_int8(x, ws[0], code, outs[v]):
                raise ValueError(f"this build has no int8 kernel for {f}")
        if (outs[base] - outs[other]).abs().max() > 1e-5 * outs[base].abs().max():
            raise ValueError(f"{f}: {base} and {other} give other sums")
    for r in range(-1, rounds):  # round -1 warms up, unrecorded
        order = (base, other) if r % 2 == 0 else (other, base)
        for f in formats:
            for rows, where in cases:
                x, out = torch.randn(rows, k), torch.empty(rows, n)
                for v in order:
                    built, layout = variants[v]
                    code, ws = weights[f][where][layout]
                    seconds = _call_s(built, x, code, ws, out)
                    if r >= 0:
                        times[f][(rows, where)][v].append(seconds)
        if r >= 0:
            log(f"  round {r + 1} of {rounds}: " + "; ".join(
                f"{f} " + " ".join(f"{times[f][c][base][-1] / times[f][c][other][-1]:.2f}x"
                                   for c in cases) for f in formats))
    macs = {c: c[0] * n * k for c in cases}
    return {
        "shape": list(shape), "rounds": rounds, "memory_bytes": memory_bytes,
        "activations": "int8",
        "formats": {f: {_case_name(*c): {
            "rows": c[0], "where": c[1],
            **{f"{v}_gmacs": [macs[c] / s / 1e9 for s in times[f][c][v]] for v in variants},
            # the baseline's time over the other's
            f"{other}_over_{base}": paired_ratio(times[f][c][base], times[f][c][other]).to_dict(),
        } for c in cases} for f in formats},
    }


def run_gguf_layouts_bench(rounds: int, formats=FORMATS, shape: tuple[int, int] = SHAPE,
                           cases=CASES, memory_bytes: int = MEMORY_BYTES,
                           log: Callable[[str], None] = print) -> dict[str, Any]:
    """The file's layout (the baseline) against runs of rows, on this CPU's own build."""
    from kvserve.kernels import load_kernels

    kernels = load_kernels()
    return run_paired_variants(rounds, {"file": (kernels, "file"), "runs": (kernels, "runs")},
                               formats, shape, cases, memory_bytes, log)


def run_paired_command(args, command: str, settings: dict[str, Any],
                       run: Callable[[], dict[str, Any]], keys: tuple[str, str],
                       title: str) -> int:
    """A kernels' A/B as a command: its settings and machine, ``run()``'s result as a
    table of the two variants (``keys``: the baseline's, the other's), and its JSON."""
    import statistics

    from kvserve.bench.reports import report

    info = report.machine_info()
    report.print_settings(f"kvserve {command}", {**settings, "rounds": args.rounds})
    print(report.machine_line(info))
    try:
        result = run()
    except ValueError as exc:
        raise SystemExit(f"kvserve: error: {exc}") from None
    base, other = keys
    rows = []
    for f, cases in result["formats"].items():
        for name, c in cases.items():
            ratio = c[f"{other}_over_{base}"]
            rows.append((f, name, f"{statistics.median(c[f'{base}_gmacs']):.1f}",
                         f"{statistics.median(c[f'{other}_gmacs']):.1f}",
                         f"{ratio['median']:.2f}x ({ratio['min']:.2f}–{ratio['max']:.2f})"))
    print(report.format_table(["format", "case", f"{base} GMAC/s", f"{other} GMAC/s", title],
                              rows))
    if args.json:
        print(f"wrote {report.write_json(args.json, {'machine': info, 'result': result})}")
    return 0


def cmd_gguf_layouts(args) -> int:
    """``kvserve bench gguf-layouts``: the runs of rows against the file's layout."""
    return run_paired_command(
        args, "gguf-layouts", {"formats": list(FORMATS), "shape": list(SHAPE),
                               "cases": [_case_name(*c) for c in CASES]},
        lambda: run_gguf_layouts_bench(args.rounds, FORMATS, SHAPE, CASES, MEMORY_BYTES),
        ("file", "runs"), "runs against the file's layout")


def add_gguf_layouts_parser(sub) -> None:
    from kvserve.bench.bench_args import add_output_args

    p = sub.add_parser("gguf-layouts", help="the GGUF kernels on runs of rows vs the file's "
                                            "layout, in alternating rounds",
                       description="Multiply a random Q4_K, Q5_K, Q6_K and Q8_0 weight "
                                   "(2048 x 2048) by 1, 4 and 256 int8 rows in cache and 1 "
                                   "from memory, in the file's layout and in runs of rows; "
                                   "report each layout's GMAC/s and the runs' speed-up.")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_gguf_layouts)
