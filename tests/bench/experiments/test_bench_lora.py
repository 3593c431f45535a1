"""``kvserve bench lora``: decode steps over four adapters (native kernel and torch's
path) against the base alone, each arm's requests really running their adapters."""
from __future__ import annotations

import json

import kvserve.bench.experiments.lora as lora_bench
from kvserve.bench.cli import main


def test_lora_bench_times_each_arm_with_its_adapters(tmp_path, model_dirs, monkeypatch):
    seen = []
    real = lora_bench._decode_step_s

    def spy(llm, batch, prompt_len, steps, loras):
        seen.append({None if r is None else r.lora_name for r in loras})
        return real(llm, batch, prompt_len, steps, loras)
    monkeypatch.setattr(lora_bench, "_decode_step_s", spy)
    out = tmp_path / "lora.json"
    rc = main(["bench", "lora", "--model", model_dirs("llama"), "--rounds", "2", "--batch",
               "8", "--rank", "4", "--decode-steps", "3", "--prompt-len", "8",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["result"]
    assert res["adapters"] == 4 and res["batch"] == 8 and res["rank"] == 4
    assert all(len(res["step_s"][arm]) == 2 for arm in lora_bench.ARMS)
    assert res["lora_over_base"]["rounds"] == res["lora_torch_over_base"]["rounds"] == 2
    adapters = {f"adapter-{i}" for i in range(4)}
    assert seen.count({None}) == 3 and seen.count(adapters) == 6  # 3 arms x (1 + 2 rounds)
