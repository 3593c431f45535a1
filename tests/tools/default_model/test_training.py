"""The embedded model's training pieces: the seeded file split and the bits-per-byte
measure it is judged by."""
from __future__ import annotations

import math
import random

import pytest

from tools.default_model.training_data import file_list_hash, split_files, train_tokenizer
from tools.default_model.training_eval import gzip_bits_per_byte, heldout_bits_per_byte


def test_split_is_seeded_disjoint_and_complete():
    paths = [f"pkg/mod{i}.py" for i in range(100)]
    train, held = split_files(paths, seed=7, fraction=0.1)
    assert (train, held) == split_files(list(reversed(paths)), seed=7, fraction=0.1)
    assert len(held) == 10 and not set(train) & set(held)
    assert sorted(train + held) == sorted(paths)
    assert split_files(paths, seed=8, fraction=0.1)[1] != held


def test_file_list_hash_ignores_order():
    assert file_list_hash(["b.py", "a.py"]) == file_list_hash(["a.py", "b.py"])
    assert file_list_hash(["a.py"]) != file_list_hash(["a.py", "b.py"])


def test_gzip_bits_per_byte_tells_redundant_from_random_bytes():
    repetitive = b"def f(x):\n    return x\n" * 200
    noise = random.Random(0).randbytes(20_000)
    assert gzip_bits_per_byte(repetitive) < 0.5       # gzip finds the repeats
    assert 7.9 < gzip_bits_per_byte(noise) < 8.1      # incompressible: ~8 bits a byte
    assert gzip_bits_per_byte(repetitive[:2000]) > gzip_bits_per_byte(repetitive)


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_per_token():
    torch = pytest.importorskip("torch")
    texts = ["def add(a, b):\n    return a + b\n", "x = 1\n"]
    tok = train_tokenizer(texts * 20, vocab_size=300)
    ids = {"bos": tok.token_to_id("<|bos|>"), "eos": tok.token_to_id("<|eos|>")}
    vocab = tok.get_vocab_size()

    class Uniform(torch.nn.Module):  # equal logits: every token costs ln(vocab) nats
        def forward(self, input_ids):
            out = type("Out", (), {})()
            out.logits = torch.zeros(*input_ids.shape, vocab)
            return out

    res = heldout_bits_per_byte(Uniform(), tok, texts, ids, ctx=4)
    tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts)
    assert res["tokens"] == tokens  # every token after bos predicted exactly once
    assert res["bytes"] == sum(len(t.encode()) for t in texts)
    assert res["bits_per_byte"] == pytest.approx(tokens * math.log2(vocab) / res["bytes"])


def test_a_headers_own_code_is_the_files_text_after_it_dedented():
    from tools.default_model.evaluate_default import function_headers, headers_and_code

    text = ("import os\n\n\nclass A:\n    def f(self,\n          x):\n        return x\n\n"
            "    def g(self): return 1\n\n\ndef h():\n    '''doc'''\n    pass\n")
    found = headers_and_code(text)
    assert [header for header, _ in found] == function_headers(text)
    by_header = dict(found)
    assert by_header["def f(self,\n      x):\n"].startswith(
        "    return x\n\ndef g(self): return 1\n\n\ndef h():\n")
    assert by_header["def h():\n"] == "    '''doc'''\n    pass\n"
    assert "def g(self): return 1\n" not in by_header  # a one-line def has no body to continue


def test_repetition_counts_a_repeated_run_of_eight_tokens():
    from tools.default_model.evaluate_default import code_repetition, repeats_ngram

    assert repeats_ngram(list(range(8)) * 2) and not repeats_ngram(list(range(64)))
    assert not repeats_ngram(list(range(7)) * 2 + [99])

    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return type("E", (), {"ids": [ord(c) for c in text]})()

    res = code_repetition(Chars(), ["abcdefghabcdefgh", "abcdefghijklmnop"])
    assert (res["repeating"], res["headers"], res["repeating_share"]) == (1, 2, 0.5)
