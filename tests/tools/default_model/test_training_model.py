"""The default model's training parts: the schedule, the model presets, the losses."""
from __future__ import annotations

import math

import pytest

from tools.default_model.training_model import PRESETS, atomic_torch_save, build_model, \
    distill_loss_fn, loss_fn, lr_at

IDS = {"bos": 0, "eos": 1, "pad": 2}


def test_lr_warms_up_linearly_then_decays_to_the_floor():
    base, warm = 1e-3, 10
    assert lr_at(0.0, 0, base, warm) == pytest.approx(base / warm)
    assert lr_at(0.0, warm - 1, base, warm) == pytest.approx(base)
    assert lr_at(0.0, warm, base, warm) == pytest.approx(base)          # cosine at its top
    assert lr_at(0.5, 50, base, warm) == pytest.approx(base * 0.55)     # half-way: the mean
    assert lr_at(1.0, 99, base, warm) == pytest.approx(base * 0.1)      # the floor
    assert lr_at(3.0, 99, base, warm) == pytest.approx(base * 0.1)      # past the budget
    later = [lr_at(p / 10, 20 + p, base, warm) for p in range(11)]
    assert all(a >= b for a, b in zip(later, later[1:]))


def test_presets_build_the_shapes_they_name():
    pytest.importorskip("transformers")
    model = build_model(PRESETS["tiny"], vocab_size=64, ids=IDS, max_pos=32)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (128, 2, 2)
    assert cfg.head_dim == 128 // 4 and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_losses_start_near_uniform_and_distillation_from_itself_is_zero(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], vocab_size=64, ids=IDS, max_pos=32).eval()
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert loss_fn(model, x, y).item() == pytest.approx(math.log(64), rel=0.05)
        assert distill_loss_fn(model)(model, x, y).item() == pytest.approx(0.0, abs=1e-6)
        other = build_model(PRESETS["tiny"], vocab_size=64, ids=IDS, max_pos=32).eval()
        assert distill_loss_fn(other)(model, x, y).item() > 1e-4
    path = tmp_path / "ckpt.pt"
    atomic_torch_save({"step": 3}, path)
    assert torch.load(path)["step"] == 3 and not path.with_suffix(".pt.tmp").exists()
