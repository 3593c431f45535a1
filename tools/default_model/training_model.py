"""The default model's trainable parts: size presets, the model, AdamW, the losses (the
corpus's next token, or a teacher's distribution for the draft) and the learning-rate
schedule. Used by :mod:`tools.default_model.train_default`; transformers and torch are
imported where used (dev dependencies)."""
from __future__ import annotations

import math
import os
from pathlib import Path

# Size presets: (hidden, layers, heads, kv_heads, intermediate). head_dim = hidden/heads.
PRESETS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384),
    "s256x4": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=768),
    "s256x6": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, intermediate_size=768),
    "s320x6": dict(hidden_size=320, num_hidden_layers=6, num_attention_heads=5, num_key_value_heads=1, intermediate_size=864),
    "s384x6": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024),
}
DEFAULT_PRESET = "s256x4"


def atomic_torch_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def lr_at(progress: float, step: int, base_lr: float, warmup_steps: int, min_ratio: float = 0.1) -> float:
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    p = min(max(progress, 0.0), 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def build_model(preset: dict, vocab_size: int, ids: dict, max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        head_dim=preset["hidden_size"] // preset["num_attention_heads"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        **preset,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.float()
    return model


def make_optimizer(model, lr: float, weight_decay: float):
    import torch

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def loss_fn(model, x, y):
    import torch.nn.functional as F

    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def distill_loss_fn(teacher):
    """KL(teacher || student) over every position's next-token distribution."""
    import torch
    import torch.nn.functional as F

    def loss(model, x, y):
        with torch.no_grad():
            target = F.log_softmax(teacher(input_ids=x).logits.float(), dim=-1)
        student = F.log_softmax(model(input_ids=x).logits, dim=-1)
        return F.kl_div(student.reshape(-1, student.size(-1)),
                        target.reshape(-1, target.size(-1)), log_target=True,
                        reduction="batchmean")
    return loss
