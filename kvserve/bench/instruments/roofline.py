"""The machine's ceilings: fp32 GEMM GFLOP/s and memory bandwidth GB/s, plus the
arithmetic that turns them into bounds for a model (``kvserve bench roofline``).

Measurements use torch with a fixed thread count (2 by default, the cores of these
machines) and report the median of repeats.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

__all__ = [
    "RooflineResult",
    "GemmPeak",
    "gemm_peak",
    "MatmulShape",
    "measure_roofline",
    "measure_gemm_gflops",
    "measure_sum_bandwidth",
    "measure_stream_bandwidth",
    "measure_apart",
    "measure_gemv_bandwidth",
    "flops_per_token",
    "workload_flops",
    "roofline_bound",
    "decode_bandwidth_floor_s",
    "matmul_params",
    "roofline_share",
    "torch_threads",
]

DEFAULT_GEMM_MS: tuple[int, ...] = (1, 16, 64, 256)


@dataclass
class RooflineResult:
    """Measured ceilings; ``gemm_gflops`` maps a shape label to GFLOP/s; ``source``
    says which measurement this is (e.g. "before the runs", or the JSON file read)."""

    threads: int
    gemm_gflops: dict[str, float] = field(default_factory=dict)
    sum_bandwidth_gbs: float = 0.0  # of torch's memory or huge pages, the faster
    gemv_bandwidth_gbs: float = 0.0
    source: str = "measured"

    @property
    def peak_gflops(self) -> float:
        """The best GEMM rate measured: the compute ceiling."""
        return max(self.gemm_gflops.values(), default=0.0)

    @property
    def bandwidth_gbs(self) -> float:
        """The streaming-read bandwidth: the memory ceiling."""
        return max(self.sum_bandwidth_gbs, self.gemv_bandwidth_gbs)

    def best_of(self, other: RooflineResult) -> RooflineResult:
        """Each ceiling at the higher of two measurements. A ceiling is the best rate the
        machine was seen to reach; this machine's speed drifts by several percent within
        minutes, and a ceiling measured in a slow minute put a run at 114 % of it."""
        gemm = dict(self.gemm_gflops)
        for shape, rate in other.gemm_gflops.items():
            gemm[shape] = max(rate, gemm.get(shape, 0.0))
        return RooflineResult(self.threads, gemm,
                              max(self.sum_bandwidth_gbs, other.sum_bandwidth_gbs),
                              max(self.gemv_bandwidth_gbs, other.gemv_bandwidth_gbs),
                              f"the higher of {self.source} and {other.source}")

    def to_dict(self) -> dict[str, object]:
        """JSON-able form, with the derived ceilings."""
        d = asdict(self)
        d["peak_gflops"] = self.peak_gflops
        d["bandwidth_gbs"] = self.bandwidth_gbs
        return d


@dataclass(frozen=True)
class GemmPeak:
    """The compute ceiling a roofline share divides by, and where it was measured."""

    gflops: float
    shape: str
    source: str

    def describe(self) -> str:
        return f"{self.gflops:.1f} GFLOP/s ({self.shape}, {self.source})"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def gemm_peak(measurements: Sequence[RooflineResult]) -> GemmPeak | None:
    """The best GEMM rate of every measurement a run made (each pass, each shape of its
    sweep): the machine reached it, so no share of a lower one is an honest share."""
    rates = [(rate, shape, m.source) for m in measurements
             for shape, rate in m.gemm_gflops.items()]
    if not rates:
        return None
    rate, shape, source = max(rates, key=lambda item: item[0])
    return GemmPeak(rate, shape, source)


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``, restoring the old count after."""
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _median_time(fn: Callable[[], object], repeats: int, min_time: float = 0.05) -> float:
    """Median seconds per call; each sample loops until ``min_time`` has passed."""
    fn()  # warm-up
    samples = []
    for _ in range(max(1, repeats)):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def measure_gemm_gflops(m: int, k: int, n: int, repeats: int = 5, packed: bool = False) -> float:
    """GFLOP/s of an fp32 ``[m x k] @ [k x n]`` matmul (2mkn FLOPs).

    ``packed``: through oneDNN with the weight packed once, as kvserve's linear layers
    run (the best GEMM this CPU offers through torch, so it belongs in the ceiling).
    """
    import torch

    from kvserve.model.execution import ExecutionMode
    from kvserve.model.layers import Linear

    a = torch.randn(m, k)
    with torch.inference_mode():
        if packed:
            layer = Linear(k, n, bias=False)
            layer.configure(ExecutionMode(packed_linear=True))
            t = _median_time(lambda: layer(a), repeats)
        else:
            b, out = torch.randn(k, n), torch.empty(m, n)
            t = _median_time(lambda: torch.matmul(a, b, out=out), repeats)
    return 2.0 * m * k * n / t / 1e9


def measure_sum_bandwidth(num_mb: int = 256, repeats: int = 5, huge_pages: bool = False
                          ) -> float:
    """GB/s of ``tensor.sum()`` over a large fp32 tensor (streaming read), allocated by
    torch or on transparent huge pages (worker/huge_pages.py)."""
    import torch

    from kvserve.worker.huge_pages import huge_page_zeros

    numel = num_mb * (1 << 20) // 4
    x = huge_page_zeros((numel,), torch.float32) if huge_pages else torch.empty(numel)
    x.fill_(1.0)
    with torch.inference_mode():
        t = _median_time(lambda: x.sum(), repeats)
    return x.numel() * 4 / t / 1e9


def measure_stream_bandwidth(num_mb: int = 256, repeats: int = 5) -> float:
    """The faster streaming read of torch's memory and of huge pages (where the kernel
    offers them): the floor for weights the engine keeps on either."""
    from kvserve.worker.huge_pages import huge_pages_available

    kinds = [False, True] if huge_pages_available() else [False]
    return max(measure_sum_bandwidth(num_mb, repeats, huge) for huge in kinds)


def measure_apart(name: str, **kwargs) -> float:
    """``name`` (one of this module's measurements) with ``kwargs``, run in a child
    process. A bench with an engine in its process measures reads there: torch's parallel
    sum started from this thread leaves an OpenMP team behind, and with more threads
    than cores libgomp stops spinning at its barriers, so every parallel torch op of the
    engine's eager steps afterwards waits on a futex (a Qwen3-MoE's eager decode at a
    third of its rate)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from kvserve.bench.instruments import roofline; "
            "print(json.dumps(getattr(roofline, sys.argv[1])(**json.loads(sys.argv[2]))))")
    proc = subprocess.run([sys.executable, "-c", code, name, json.dumps(kwargs)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {name} in a child process failed: {proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def measure_gemv_bandwidth(k: int = 4096, n: int = 8192, repeats: int = 5) -> float:
    """GB/s of an fp32 GEMV ``[1 x k] @ [k x n]`` counting the weight bytes read."""
    import torch

    a, w = torch.randn(1, k), torch.randn(k, n)
    with torch.inference_mode():
        t = _median_time(lambda: a @ w, repeats)
    return k * n * 4 / t / 1e9


def measure_roofline(
    threads: int = 2,
    ms: Sequence[int] = DEFAULT_GEMM_MS,
    k: int = 768,
    n: int = 2048,
    cube: int | None = 2048,
    repeats: int = 5,
    bandwidth_mb: int = 256,
    source: str = "measured",
) -> RooflineResult:
    """Measure GEMM rates for each ``m`` (plain and packed, and a ``cube``^3 matmul)
    and bandwidths; ``source`` labels this measurement."""
    from kvserve.model.linear_method import packed_linear_available

    with torch_threads(threads):
        res = RooflineResult(threads=threads, source=source)
        for m in ms:
            res.gemm_gflops[f"{m}x{k}x{n}"] = measure_gemm_gflops(m, k, n, repeats)
        if packed_linear_available():
            for m in ms:
                res.gemm_gflops[f"packed {m}x{k}x{n}"] = measure_gemm_gflops(
                    m, k, n, repeats, packed=True)
        if cube:
            res.gemm_gflops[f"{cube}^3"] = measure_gemm_gflops(cube, cube, cube, max(1, repeats // 2))
        res.sum_bandwidth_gbs = measure_stream_bandwidth(bandwidth_mb, repeats)
        res.gemv_bandwidth_gbs = measure_gemv_bandwidth(repeats=repeats)
    return res


# ---------------------------------------------------------------------------- arithmetic


@dataclass(frozen=True)
class MatmulShape:
    """A Llama-style model's matmul weights: the decoder layers' linear layers and the
    LM head (the input embedding is a lookup, 0 FLOPs)."""

    layer_params: int
    lm_head_params: int
    num_layers: int
    hidden: int

    @classmethod
    def from_config(cls, config: dict) -> MatmulShape:
        """From an HF config dict (its ``text_config`` when it has one)."""
        cfg = config.get("text_config", config)
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or h // heads)
        inter = int(cfg["intermediate_size"])
        layers = int(cfg["num_hidden_layers"])
        per_layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter
        return cls(layers * per_layer, h * int(cfg["vocab_size"]), layers, h)

    @property
    def params(self) -> int:
        return self.layer_params + self.lm_head_params


def matmul_params(config: dict) -> int:
    """Parameters that take part in matmuls: every linear layer plus the LM head."""
    return MatmulShape.from_config(config).params


def flops_per_token(params: int, num_layers: int = 0, hidden: int = 0, ctx: float = 0) -> float:
    """FLOPs to process one token: ``2 * params`` for the matmuls plus attention,
    ``2 * 2 * layers * ctx * hidden`` (QK^T and AV over ``ctx`` cached positions)."""
    return 2.0 * params + 4.0 * num_layers * ctx * hidden


def workload_flops(requests: Sequence[tuple[int, int]], shape: MatmulShape) -> float:
    """The FLOPs any engine must do for a workload of ``(prompt_len, output_len)``
    requests: the decoder layers for every prompt token and every output token but the
    last (fed back in), and the LM head only where a token is sampled, the last prompt
    position and each fed-back output token (``output_len`` rows a request). The
    attention term sums each forward token's context length exactly."""
    total = 0.0
    for plen, olen in requests:
        ntok = plen + max(olen - 1, 0)
        ctx_sum = ntok * (ntok + 1) / 2.0  # token i attends to positions 0..i
        total += (2.0 * shape.layer_params * ntok + 2.0 * shape.lm_head_params * olen
                  + 4.0 * shape.num_layers * shape.hidden * ctx_sum)
    return total


def roofline_bound(
    params: int,
    tokens: int,
    gflops: float,
    num_layers: int = 0,
    hidden: int = 0,
    ctx: float = 0,
) -> dict[str, float]:
    """Compute-bound time for ``tokens`` tokens at ``gflops`` GFLOP/s.

    Returns ``flops`` (total), ``seconds`` (GEMM-bound time) and ``tokens_per_s``
    (the ceiling), with ``ctx`` the mean context length for the attention term.
    """
    flops = flops_per_token(params, num_layers, hidden, ctx) * tokens
    seconds = flops / (gflops * 1e9) if gflops > 0 else float("inf")
    return {
        "flops": flops,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"),
    }


def decode_bandwidth_floor_s(weight_bytes: float, bandwidth_gbs: float) -> float:
    """Least time of one batch-1 decode step: every weight byte read once."""
    return weight_bytes / (bandwidth_gbs * 1e9) if bandwidth_gbs > 0 else float("inf")


def roofline_share(achieved_flops: float, seconds: float, gflops: float) -> float:
    """Achieved FLOP/s as a fraction of the GEMM ceiling."""
    if seconds <= 0 or gflops <= 0:
        return 0.0
    return achieved_flops / seconds / (gflops * 1e9)
