"""``bench gguf-agreement``: the reader of llama-perplexity's log-probability file on a file
written to its layout, and (slow: llama.cpp's tools are built) the whole comparison on
the embedded model, whose Q8_0 and Q4_K_M files kvserve must score as llama.cpp does and,
with float activations, as exact arithmetic on the dequantized file does."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kvserve.bench.experiments.gguf_agreement import read_logits_file, run_gguf_agreement
from tests.format_tools import llama_cpp_source, llama_cpp_tool


def test_the_log_probability_file_is_read_as_llama_perplexity_writes_it(tmp_path):
    n_ctx, n_vocab, n_chunk = 8, 5, 2
    rows = n_ctx - 1 - n_ctx // 2
    tokens = np.arange(n_chunk * n_ctx, dtype=np.int32)
    row_len = 2 * ((n_vocab + 1) // 2) + 4
    table = np.zeros((n_chunk, rows, row_len), dtype=np.uint16)
    want_top = np.random.default_rng(0).integers(0, n_vocab, (n_chunk, rows))
    for c in range(n_chunk):
        for r in range(rows):
            table[c, r, :4] = np.array([0.001, -10.0], dtype=np.float32).view(np.uint16)
            table[c, r, 4:4 + n_vocab] = 100
            table[c, r, 4 + want_top[c, r]] = 60000
            table[c, r, 4 + n_vocab:] = 65535  # the row's padding is not a token
    tokens %= n_vocab
    targets = tokens.reshape(n_chunk, n_ctx)[:, n_ctx - rows:]
    codes = np.where(targets == want_top, 60000, 100)
    want_nll = -float((codes * np.float32(0.001) + np.float32(-10.0)).sum())
    path = tmp_path / "logits.bin"
    path.write_bytes(b"_logits_" + struct.pack("<iii", n_ctx, n_vocab, n_chunk)
                     + tokens.tobytes() + table.tobytes())
    got = read_logits_file(path)
    assert (got["n_ctx"], got["n_vocab"]) == (n_ctx, n_vocab)
    assert (got["tokens"] == tokens.reshape(n_chunk, n_ctx)).all()
    assert (got["top"] == want_top).all()
    assert got["nll"] == pytest.approx(want_nll, rel=1e-6)
    path.write_bytes(b"not-logits")
    with pytest.raises(ValueError, match="not a llama-perplexity log-probability file"):
        read_logits_file(path)


@pytest.mark.slow
def test_kvserve_scores_the_embedded_models_gguf_files_as_llama_cpp_does():
    from kvserve.bench.experiments.spec import heldout_texts
    from kvserve.default_model import default_model_dir

    tree = llama_cpp_source(Path.home() / ".cache" / "kvserve-tests" / "llama-cpp")
    text = "\n\n".join(heldout_texts(default_model_dir(), 40))[:200_000]
    def scores(activations: str) -> dict:
        return run_gguf_agreement(
            Path(default_model_dir()), tree, str(llama_cpp_tool(tree, "llama-quantize")),
            str(llama_cpp_tool(tree, "llama-perplexity")), ["Q8_0", "Q4_K_M", "BF16"], text, ctx=256,
            chunks=16, threads=2,
            engine_args={"num_kv_blocks": 256, "gguf_activations": activations},
            log=lambda msg: None)["quants"]

    # with float activations kvserve computes the file's numbers: it puts first what
    # float64 arithmetic on the dequantized file does (100 % over 16k tokens on the
    # embedded model; a near tie may flip between float32 and float64)
    for quant, r in scores("float").items():
        assert r["kvserve_top1_agreement_with_exact"] >= 0.998, (quant, r)
    # by default it rounds activations as llama.cpp does (to 8 bits against the blocks, to
    # bfloat16 against BF16 weights):
    # both then stray from exact arithmetic by about as much (98-99 % top-1 on this small
    # model's near ties), not at the same positions, and agree with llama.cpp about as
    # well as llama.cpp's two attention paths agree with each other (2000 positions:
    # 1.5 points is 30 of them, about four standard deviations of the difference between the
    # two counts of disagreements); bits per byte is the tight check
    for quant, r in scores("int8").items():
        assert r["kvserve_top1_agreement_with_exact"] >= 0.97, (quant, r)
        assert r["top1_agreement"] >= 0.97, (quant, r)
        assert r["top1_agreement"] >= r["llamacpp_top1_agreement_with_fa_off"] - 0.015, (quant, r)
        assert abs(r["kvserve_over_llamacpp_bits_per_byte"] - 1) < 0.01, (quant, r)
