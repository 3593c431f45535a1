"""LiveStats: rates, percentiles and shares over the last seconds, computed by readers."""
from __future__ import annotations

from kvserve.metrics.live import LiveStats, Totals


def test_rates_percentiles_and_shares():
    live = LiveStats("m", "paged", 64, start=0.0)
    for second in range(1, 21):  # 20 s: 100 prompt and 50 generated tokens a second
        live.record(Totals(float(second), running=2, waiting=1, kv_usage=0.5,
                           prompt_tokens=100 * second, generation_tokens=50 * second,
                           prefix_queries=10 * second, prefix_hits=4 * second,
                           transfer_bytes=(1000 * second, 0, 0, 0),
                           step_seconds=(0.6 * second, 0.3 * second, 0.1 * second),
                           profiled_steps=10 * second))
    for i in range(100):
        live.ttft.append((19.0, (i + 1) / 1000))    # 1..100 ms
        live.tpot.append((19.0, 0.02))
    view = live.view(now=20.0)
    assert view["running"] == 2 and view["waiting"] == 1
    assert round(view["tokens_per_s"]["prompt"], 6) == 100
    assert round(view["tokens_per_s"]["generation"], 6) == 50
    assert view["ttft_ms"]["p50"] == 50.5 and 99 <= view["ttft_ms"]["p99"] <= 100
    assert view["tpot_ms"] == {"p50": 20.0, "p99": 20.0}
    assert round(view["prefix_cache"]["hit_rate"], 6) == 0.4
    assert round(view["kv_transfer"]["bytes_per_s"]["swap_out"]) == 1000
    assert {k: round(v, 6) for k, v in view["step_time"].items()} == {
        "step_ms": 100.0, "linear": 0.6, "attention": 0.3, "other": 0.1}
    assert view["kv"]["manager"] == "paged" and view["kv"]["num_blocks"] == 64
    assert len(view["history"]) == 20 and view["history"][-1]["gen_tps"] == 50
    assert view["batch"] is None and view["alerts"] == []


def test_an_idle_engine_reads_as_idle():
    live = LiveStats("m", start=0.0)
    live.record(Totals(1.0, prompt_tokens=500, generation_tokens=500))
    view = live.view(now=60.0)   # no step since: the totals still hold, rates fall to 0
    assert view["tokens_per_s"] == {"prompt": 0.0, "generation": 0.0}
    assert view["ttft_ms"] == {"p50": None, "p99": None}
    assert view["step_time"]["step_ms"] is None and view["prefix_cache"]["hit_rate"] is None
