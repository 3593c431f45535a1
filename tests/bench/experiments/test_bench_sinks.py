"""``kvserve bench sinks``: perplexity of held-out text past the training context with a
window, with sinks beside it, and in pieces of the training length."""
from __future__ import annotations

import json

from kvserve.bench.cli import main


def test_sinks_bench_scores_each_way(tmp_path):
    out = tmp_path / "sinks.json"
    rc = main(["bench", "sinks", "--num-texts", "2", "--training-context", "64",
               "--context-factor", "4", "--sinks", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["result"]
    assert res["tokens_per_text"] == 256 and res["windows"] == {"window": 64, "sinks": 62}
    assert set(res["perplexity"]) == {"window", "sinks", "pieces"}
    assert all(1 < p < 8192 for p in res["perplexity"].values())
    # the two streaming runs read the same first window: they differ only past it
    assert res["perplexity"]["window"] != res["perplexity"]["sinks"]
