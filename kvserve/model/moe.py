"""A mixture-of-experts MLP: a router picks each token's top-k experts, the tokens are
grouped by expert, and each expert that any token chose runs once, as one gated MLP over
its tokens (one GEMM per active expert and projection). At one token a step only the
chosen experts' weights are read. Optionally a shared expert every token passes through,
scaled by a sigmoid gate (Qwen2-MoE)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.config import ArchConfig
from kvserve.model.decoder import GatedMLP
from kvserve.model.layers import Linear


class SparseMoE(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(GatedMLP(cfg, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.eager_counts = [0, 0]  # experts run, and tokens routed, by eager steps
        # the same two counts of captured steps: an int64 [2] the native step adds to
        self.captured_counts: torch.Tensor | None = None
        self.native = None  # kvserve.kernels.Kernels: routing through moe_route
        self.native_router: torch.Tensor | None = None  # its router weight, found once

    @property
    def expert_calls(self) -> int:
        """Experts run since start, each once for all the tokens of a step it took (bench
        moe)."""
        captured = 0 if self.captured_counts is None else int(self.captured_counts[0])
        return self.eager_counts[0] + captured

    @property
    def tokens_routed(self) -> int:
        """Tokens routed since start."""
        captured = 0 if self.captured_counts is None else int(self.captured_counts[1])
        return self.eager_counts[1] + captured

    def configure(self, mode) -> None:
        kernels = getattr(mode, "kernels", None)
        self.native = kernels if kernels is not None and kernels.available else None
        self.native_router = self.router_weight() if self.native is not None else None

    def router_weight(self) -> torch.Tensor | None:
        """The router's float32 [experts, hidden] weight in memory, where the native
        router can read it (a float weight, or a GGUF file's F32 tensor); else None."""
        method = self.gate.method
        parts = list(method.parts(self.gate)) if hasattr(method, "parts") else None
        if parts is not None:
            weight = parts[0][3] if len(parts) == 1 and parts[0][2] == "float" else None
        else:
            weight = getattr(self.gate, "weight", None)
        if (weight is None or self.gate.bias is not None or weight.dtype != torch.float32
                or weight.device.type != "cpu" or not weight.is_contiguous()
                or getattr(self.gate, "lora", None) is not None):
            return None
        return weight

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] and their weights [T, k] (softmax over all
        experts in float32, the top k kept, renormalised where the model says). With the
        native kernels, a float32 step routes through their loops, as the captured step
        does."""
        if (self.native_router is not None and x.dtype == torch.float32
                and x.device.type == "cpu"):
            return self.native.moe_route(x.contiguous(), self.native_router, self.top_k,
                                         self.norm_topk_prob)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        if x.shape[0] == 1:
            out = self._one_token(x, chosen[0].tolist(), weights[0])
        else:
            out = self._grouped(x, chosen, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert._forward(x)
        return out

    def _one_token(self, x: torch.Tensor, chosen: list[int], weights: torch.Tensor
                   ) -> torch.Tensor:
        """One token: its experts in expert order (the grouped path's sums, bit for bit),
        without sorting or scattering."""
        self.eager_counts[0] += len(chosen)
        self.eager_counts[1] += 1
        out = None
        for slot in sorted(range(len(chosen)), key=chosen.__getitem__):
            y = self.experts[chosen[slot]]._forward(x) * weights[slot]
            out = y if out is None else out + y
        return out

    def _grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)   # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        scale = weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        self.eager_counts[1] += x.shape[0]
        for expert, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count:
                self.eager_counts[0] += 1
                rows = tokens[start:start + count]
                out.index_add_(0, rows, self.experts[expert]._forward(x[rows])
                               * scale[start:start + count])
                start += count
        return out
