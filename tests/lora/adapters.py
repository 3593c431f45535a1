"""The LoRA tests' adapters: what peft makes for each tiny model, and the prompts."""
from __future__ import annotations

LENGTHS = [5, 17, 30, 9, 12, 40, 3, 22, 33, 7]
MAX_TOKENS = 12
# (rank, rsLoRA, modules, more config): ranks below and at the maximum, a rank and an
# alpha of their own for some modules, rsLoRA's scaling, an adapter of the attention alone
ADAPTERS = [(4, False, None, {}),
            (8, False, None, {"rank_pattern": {"down_proj": 4}, "alpha_pattern": {"o_proj": 40}}),
            (8, True, None, {}), (16, False, ["q_proj", "v_proj"], {})]
# Phi-3's checkpoints hold q/k/v and gate/up fused: its adapters target the fused modules
FUSED_MODULES = {None: ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                 ("q_proj", "v_proj"): ["qkv_proj"]}


def modules_of(arch: str, modules: list[str] | None) -> list[str] | None:
    if not arch.startswith("phi3"):
        return modules
    return FUSED_MODULES[tuple(modules) if modules else None]
