"""``kvserve bench moe``: a MoE model's batch-1 decode against a dense model of the same
size, with the bytes each decode step reads and the experts each layer ran."""
from __future__ import annotations

import json

from kvserve.bench.cli import main


def test_moe_decode_reads_only_the_routed_experts(tmp_path, model_dirs):
    out = tmp_path / "moe.json"
    rc = main(["bench", "moe", "--model", model_dirs("qwen3-moe"), "--rounds", "2",
               "--decode-steps", "6", "--prompt-len", "8", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["result"]
    assert res["experts_run_per_routed_token"] == res["experts_per_tok"] == 2
    weights, read = res["weight_bytes"], res["bytes_read_per_token"]
    assert abs(weights["moe"] - weights["dense"]) < 0.02 * weights["dense"]  # same size
    assert read["dense"] == weights["dense"]
    # 4 experts, 2 routed: half the experts' bytes are not read
    assert read["moe"] < 0.8 * read["dense"]
    assert len(res["step_s"]["moe"]) == len(res["step_s"]["dense"]) == 2
    assert res["dense_over_moe"]["median"] > 0
