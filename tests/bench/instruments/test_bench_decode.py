"""Single-stream decode measurement: weight accounting and a real run."""
from __future__ import annotations

import torch

from kvserve import LLM
from kvserve.bench.instruments.decode import DecodeResult, matmul_weight_bytes, measure_decode
from kvserve.kernels import load_kernels


def test_weight_bytes_leave_out_embedding_lookups(llama_dir):
    llm = LLM(llama_dir)
    model = llm.engine.worker.runner.model
    cfg = model.config
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
    expected = (cfg.num_layers * per_layer + cfg.hidden_size
                + cfg.vocab_size * cfg.hidden_size) * 4  # + final norm + LM head
    assert matmul_weight_bytes(model) == expected


def test_weight_bytes_of_an_int8_model(llama_dir):
    model = LLM(llama_dir, quantization="int8").engine.worker.runner.model
    cfg = model.config
    outs = [(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size,
            2 * cfg.intermediate_size, cfg.hidden_size]
    ins = [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size]
    runs = load_kernels().int8_pack_runs(torch.zeros(8, 64, dtype=torch.int8)) is not None
    if runs:  # AVX-512 VNNI: int8 rows in runs of 8 (the last repeats rows) + row sums
        linear = sum(-(-o // 8) * 8 * i + 8 * o for o, i in zip(outs, ins))
    else:  # int8 weights + float scales
        linear = sum(o * i + 4 * o for o, i in zip(outs, ins))
    expected = (cfg.num_layers * (linear + 2 * cfg.hidden_size * 4) + cfg.hidden_size * 4
                + cfg.vocab_size * cfg.hidden_size * 4)  # norms, final norm, float LM head
    assert matmul_weight_bytes(model) == expected


def test_measure_decode_counts_decode_steps_only(llama_dir):
    llm = LLM(llama_dir)
    res = measure_decode(llm, [5, 6, 7, 8], new_tokens=6, repeats=2)
    assert res.steps == 2 * 5  # 6 tokens: the first comes from the prefill step
    assert res.median_step_s > 0 and res.tok_s == 1 / res.median_step_s
    assert not llm.engine.has_unfinished_requests()


def test_vs_floor_arithmetic():
    res = DecodeResult(steps=10, median_step_s=0.025, weight_bytes=int(3.5e8))
    assert abs(res.vs_floor(17.5) - 1.25) < 1e-9  # floor 20 ms
