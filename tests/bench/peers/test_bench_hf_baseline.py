"""HF static baseline on a tiny model: each batch generates exactly its largest max_tokens."""

from __future__ import annotations

from pathlib import Path

from kvserve.bench.peers.hf_baseline import load_hf_model, run_hf_static, sweep_hf_static
from kvserve.bench.workloads.definitions import BenchRequest
from kvserve.bench.workloads.models import BenchModelSpec, make_bench_model

REQS = [
    BenchRequest([5, 6, 7], 3),
    BenchRequest([8, 9, 10, 11, 12], 5),
    BenchRequest([13, 14], 4),
]


def test_static_batches_generate_full_length(tiny_model_dir: Path) -> None:
    model = load_hf_model(tiny_model_dir)
    res = run_hf_static(model, REQS, batch_size=2)
    assert [(b.size, b.padded_prompt_len, b.max_new_tokens) for b in res.batches] == [(2, 5, 5), (1, 2, 4)]
    assert res.useful_output_tokens == 3 + 5 + 4
    assert res.generated_tokens == 2 * 5 + 4
    assert res.prompt_tokens == 10 and res.total_tokens == 22
    assert res.wall_s > 0 and res.useful_tok_s > 0
    d = res.to_dict()
    assert d["useful_output_tokens"] == 12 and len(d["batches"]) == 2

    best, all_res = sweep_hf_static(model, REQS, [1, 3])
    assert [r.batch_size for r in all_res] == [1, 3]
    assert all_res[0].generated_tokens == 12 and all_res[1].generated_tokens == 15
    assert best in all_res


def test_model_without_eos(tmp_path: Path) -> None:
    spec = BenchModelSpec(16, 1, 2, 1, 32, vocab_size=40, max_position_embeddings=64)
    model = load_hf_model(make_bench_model(spec, tmp_path, copy_tokenizer=False))
    res = run_hf_static(model, REQS, batch_size=16, warmup=False)
    assert len(res.batches) == 1 and res.generated_tokens == 15 and res.useful_output_tokens == 12
