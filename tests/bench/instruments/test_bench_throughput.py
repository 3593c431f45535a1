"""The token rates kvserve's offline runs and HF's static batches share."""
from __future__ import annotations

from kvserve.bench.instruments.throughput import ThroughputResult
from kvserve.bench.peers.hf_baseline import HFResult


def test_rates_count_prompt_and_useful_tokens_alike():
    ours = ThroughputResult(wall_s=2.0, num_requests=3, prompt_tokens=10,
                            useful_output_tokens=6, generated_tokens=8)
    hf = HFResult(batch_size=4, wall_s=2.0, num_requests=3, prompt_tokens=10,
                  useful_output_tokens=6, generated_tokens=9)
    for res in (ours, hf):
        assert (res.total_tokens, res.useful_tok_s, res.total_tok_s, res.requests_per_s) \
            == (16, 3.0, 8.0, 1.5)
        d = res.to_dict()
        assert list(d)[-4:] == ["total_tokens", "useful_tok_s", "total_tok_s", "requests_per_s"]
        assert d["requests_per_s"] == 1.5
    assert HFResult(4, 0.0, 3, 10, 6, 9).to_dict()["useful_tok_s"] == 0.0
