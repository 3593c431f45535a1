"""``kvserve bench gguf-vnni``: the int8 GGUF kernels as built for a CPU with AVX-512 VNNI
(vpdpbusd and vpdpwssd, kernels/vec_math.h) against the same sources built for AVX2
(``-mno-avx512f``: vpmaddubsw and vpmaddwd), in alternating rounds.

Both builds sum the same integers, so their outputs are equal bit for bit (checked
before timing); only the instructions differ. The weights are in runs of rows (the
engine's layout) and the cases are ``bench gguf-layouts``'s: 1, 4 and 256 rows in cache,
1 row from memory. The figure is the AVX2 build's time over the VNNI build's, the median
of the rounds' ratios. On a CPU without AVX-512 VNNI both builds are the AVX2 code, and
the command says so instead of timing them.
"""
from __future__ import annotations

from typing import Any, Callable

from kvserve.bench.experiments.gguf_layouts import (CASES, FORMATS, MEMORY_BYTES, SHAPE,
                                                    _case_name, run_paired_command,
                                                    run_paired_variants)

AVX2_FLAGS = ("-mno-avx512f",)  # the baseline build: AVX2's integer dot products


def run_gguf_vnni_bench(rounds: int, formats=FORMATS, shape: tuple[int, int] = SHAPE,
                        cases=CASES, memory_bytes: int = MEMORY_BYTES,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
    """The AVX2 build (the baseline) against this CPU's own, which has VNNI."""
    import torch

    from kvserve.kernels import Kernels, load_kernels
    from kvserve.kernels.build import cpu_has_any
    from kvserve.model.gguf.linear import FORMAT_CODES, IN_RUNS
    from kvserve.model.gguf.quants import BLOCKS, random_blocks

    if not cpu_has_any("avx512_vnni"):
        raise ValueError("this CPU has no AVX-512 VNNI: its own build of the kernels is "
                         "the AVX2 one, so there is nothing to compare")
    avx2 = Kernels(AVX2_FLAGS)
    if not avx2.available:
        raise ValueError(f"the AVX2 build of the kernels failed: {avx2.reason}")
    native = load_kernels()
    n, k = shape
    for f in formats:  # the same integers: the same bits
        blocks = torch.from_numpy(random_blocks(f, n * k // BLOCKS[f][0], seed=1)).reshape(n, -1)
        runs = native.gguf_repack_runs(blocks, f, k)
        x = torch.randn(5, k)
        got = {name: torch.empty(5, n) for name in ("avx2", "vnni")}
        avx2.gguf_rows_int8(x, runs, FORMAT_CODES[IN_RUNS[f]], got["avx2"])
        native.gguf_rows_int8(x, runs, FORMAT_CODES[IN_RUNS[f]], got["vnni"])
        if not torch.equal(got["avx2"], got["vnni"]):
            raise ValueError(f"{f}: the VNNI and AVX2 builds give other sums")
    result = run_paired_variants(rounds, {"avx2": (avx2, "runs"), "vnni": (native, "runs")},
                                 formats, shape, cases, memory_bytes, log)
    return {**result, "baseline_build_flags": list(AVX2_FLAGS)}


def cmd_gguf_vnni(args) -> int:
    """``kvserve bench gguf-vnni``: the VNNI build against the AVX2 build."""
    return run_paired_command(
        args, "gguf-vnni", {"formats": list(FORMATS), "shape": list(SHAPE),
                            "cases": [_case_name(*c) for c in CASES],
                            "baseline build flags": list(AVX2_FLAGS)},
        lambda: run_gguf_vnni_bench(args.rounds, FORMATS, SHAPE, CASES, MEMORY_BYTES),
        ("avx2", "vnni"), "VNNI against AVX2")


def add_gguf_vnni_parser(sub) -> None:
    from kvserve.bench.bench_args import add_output_args

    p = sub.add_parser("gguf-vnni", help="the GGUF int8 kernels built with AVX-512 VNNI vs "
                                         "built for AVX2, in alternating rounds",
                       description="Multiply a random Q4_K, Q5_K, Q6_K and Q8_0 weight "
                                   "(2048 x 2048, in runs of rows) by 1, 4 and 256 int8 rows "
                                   "in cache and 1 from memory, with this CPU's build of the "
                                   "kernels (VNNI) and with an AVX2 build of the same "
                                   "sources; report each build's GMAC/s and VNNI's speed-up. "
                                   "Needs a CPU with AVX-512 VNNI.")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    add_output_args(p, plot=False)
    p.set_defaults(func=cmd_gguf_vnni)
