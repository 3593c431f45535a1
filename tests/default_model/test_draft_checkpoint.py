"""The embedded draft model (kvserve/default_model/draft_checkpoint): the default model's
very tokenizer, a smaller shape, and the held-out bits per byte its training recorded."""
import json
from pathlib import Path

import pytest

from kvserve import default_draft_model_dir, default_model_dir
from tests.default_model.test_default_model import ALLOWED, REQUIRED, _bits_per_byte, \
    _heldout_sample

DRAFT_DIR, TARGET_DIR = Path(default_draft_model_dir()), Path(default_model_dir())


@pytest.fixture(scope="module")
def info():
    return json.loads((DRAFT_DIR / "training_info.json").read_text())


def test_shipped_files_and_the_targets_tokenizer():
    names = {p.name for p in DRAFT_DIR.iterdir()}
    assert REQUIRED <= names <= ALLOWED, names
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (DRAFT_DIR / name).read_bytes() == (TARGET_DIR / name).read_bytes(), name


def test_a_smaller_sibling_distilled_from_the_default_model(info):
    draft = json.loads((DRAFT_DIR / "config.json").read_text())
    target = json.loads((TARGET_DIR / "config.json").read_text())
    assert draft["vocab_size"] == target["vocab_size"]
    assert draft["num_hidden_layers"] < target["num_hidden_layers"]
    assert draft["hidden_size"] < target["hidden_size"]
    assert info["objective"].startswith("KL(teacher")
    target_info = json.loads((TARGET_DIR / "training_info.json").read_text())
    assert info["corpus"]["heldout_files"] == target_info["corpus"]["heldout_files"]
    assert info["final"]["heldout_bits_per_byte"] < info["final"]["gzip9_bits_per_byte"]


def test_heldout_bits_per_byte_is_what_training_recorded(info):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DRAFT_DIR), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(DRAFT_DIR), local_files_only=True,
                                                 dtype=torch.float32).eval()
    texts = _heldout_sample(info)
    if sum(len(t) for t in texts) < 8_000:
        pytest.skip("held-out files not found in this interpreter's stdlib")
    bpb = _bits_per_byte(model, tok, texts, 512)
    assert bpb < info["final"]["heldout_bits_per_byte"] + 0.6
