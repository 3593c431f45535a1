"""The layers decoder-only models are composed of, as vLLM's model files compose theirs.

A model file picks its parts: the attention (grouped-query, fused q/k/v, optional bias,
q/k RMSNorm per head or over the whole projection, full or partial rotary), the MLP (a
gated MLP, or the mixture of experts in ``moe.py``), and where the norms sit (before each
block, as Llama; after it, as OLMo 2). ``CausalLM`` holds the embedding, the layers, the
final norm and the LM head, and maps checkpoint names onto the fused weights.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, KVCache, paged_attention
from kvserve.model.config import ArchConfig, llama_like_config
from kvserve.model.layers import GatedActivation, Linear, RMSNorm, embedding, in_row_chunks
from kvserve.model.rotary import RotaryEmbedding


class Attention(nn.Module):
    step_part = "attention"  # for the step profiler
    tp = None  # TensorParallelGroup when sharded: o_proj gives this rank's partial sum

    def __init__(self, cfg: ArchConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # a layer with a window of its own reads that window's metadata (0: the model's),
        # or its KV group's where the pool keeps groups (set by the model runner)
        self.window = cfg.layer_windows[index] if cfg.layer_windows else 0
        self.meta_key: int | tuple[int, int] = self.window
        self.softcap = cfg.attn_softcap
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":  # Qwen3: each head's q and k normed over its dims
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        elif cfg.qk_norm == "projection":  # OLMo 2: over all heads of q, and of k
            self.q_norm = RMSNorm(self.q_size, cfg.norm_eps)
            self.k_norm = RMSNorm(self.kv_size, cfg.norm_eps)
        self.partial_rotary = (cfg.rotary_dim or cfg.head_dim) != cfg.head_dim

    def _norm_heads_(self, qkv: torch.Tensor) -> bool:
        """Each q and k head RMSNormed in place inside qkv by the native kernel (float32),
        as the captured step does; False: nothing done (the norms run on the split q, k)."""
        native = self.q_norm.native
        if (native is None or qkv.dtype != torch.float32 or qkv.stride(1) != 1
                or self.q_norm.weight.dtype != torch.float32):
            return False
        native.head_rms_norm_(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads,
                              self.num_kv_heads, self.head_dim, self.q_norm.eps)
        return True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: KVCache, meta: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        normed = self.qk_norm == "head" and self._norm_heads_(qkv)
        rotated = ((self.qk_norm is None or normed) and not self.partial_rotary
                   and rotary.rotate_qkv_(positions, qkv, self.num_heads, self.num_kv_heads,
                                          self.head_dim))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head" and not normed:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads,
                                                               self.head_dim)
        if not rotated:
            q, k = rotary(positions, q, k)
        if self.window:
            if self.meta_key not in meta.windowed:
                raise ValueError(f"no attention metadata for this layer's window {self.window}: "
                                 "build the step's inputs with the model's layer_windows")
            meta = meta.windowed[self.meta_key]
        q_sinks = None
        if meta.sinks:  # the sinks as if just before the window: the query rotated back
            far = (positions - (meta.sinks + meta.sliding_window - 1)).clamp(min=0)
            q_sinks = rotary.rotate_back(far, q)
        out = self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, out_rows,
                                          self.softcap, q_sinks).reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce_(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one GEMM."""

    tp = None  # TensorParallelGroup when sharded: down_proj gives a partial sum

    def __init__(self, cfg: ArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = GatedActivation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.gate_up_proj.lora
        out = in_row_chunks(self._forward, x, 2 * self.inter,
                            lora.rows if lora is not None else None)
        return out if self.tp is None else self.tp.all_reduce_(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


MLPFactory = Callable[[ArchConfig, int], nn.Module]  # (config, layer index) -> the MLP


def gated_mlp(cfg: ArchConfig, layer: int) -> nn.Module:
    return GatedMLP(cfg)


class DecoderLayer(nn.Module):
    """Norms before attention and before the MLP (Llama and most others)."""

    def __init__(self, cfg: ArchConfig, index: int, mlp: MLPFactory = gated_mlp) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mlp(cfg, index)

    def forward(self, x, residual, positions, rotary, cache, meta, out_rows=None):
        """x: the previous layer's MLP output, or the embeddings at the first layer
        (residual None); residual: the hidden state before it. Returns this layer's MLP
        output and the hidden state before it; each residual add is fused into the norm
        after it (the sums are the same as adding, then norming)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, cache, meta, out_rows)
        if out_rows is not None:
            residual = residual[out_rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class PostNormDecoderLayer(nn.Module):
    """Norms after attention and after the MLP, on the block's output before the residual
    add (OLMo 2)."""

    def __init__(self, cfg: ArchConfig, index: int, mlp: MLPFactory = gated_mlp) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mlp(cfg, index)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, residual, positions, rotary, cache, meta, out_rows=None):
        """As :class:`DecoderLayer`'s: x is the previous layer's normed MLP output (the
        embeddings first), added to ``residual`` here."""
        hidden = x if residual is None else residual.add_(x)
        h = self.post_attention_layernorm(
            self.self_attn(hidden, positions, rotary, cache, meta, out_rows))
        if out_rows is not None:
            hidden = hidden[out_rows]
        hidden = hidden + h
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class SandwichDecoderLayer(nn.Module):
    """Norms before and after attention and before and after the MLP, the residual adds
    after the post-norms (Gemma 2 and 3)."""

    def __init__(self, cfg: ArchConfig, index: int, mlp: MLPFactory = gated_mlp) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mlp(cfg, index)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, residual, positions, rotary, cache, meta, out_rows=None):
        """As :class:`DecoderLayer`'s: x is the previous layer's post-normed MLP output,
        added to ``residual`` in the fused add-and-norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(
            self.self_attn(h, positions, rotary, cache, meta, out_rows))
        if out_rows is not None:
            residual = residual[out_rows]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: Callable[[ArchConfig, int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class CausalLM(nn.Module):
    """forward(tokens, positions, caches, meta, out_rows) -> final hidden states [T, hidden],
    or [len(out_rows), hidden] for the rows ``out_rows``: the last layer then computes only
    the K/V of the other rows, whose outputs nothing reads.

    A model file sets ``decoder_layer`` (the layer class, or a function of the config and
    the layer's index) and, where its config differs from Llama's, ``arch_config``."""

    decoder_layer: Callable[[ArchConfig, int], nn.Module] = DecoderLayer
    notes = ""  # what the README's model table says of the architecture

    # checkpoint name fragment -> (our parameter fragment, shard index)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }
    transposed_params: tuple[str, ...] = ()

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, type(self).decoder_layer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.make_rotaries()

    def make_rotaries(self) -> None:
        """The rotary tables (buffers no checkpoint holds: the loader has them made anew
        once the model leaves the meta device); a second for windowed layers with a rope
        of their own."""
        cfg = self.config
        dim = cfg.rotary_dim or cfg.head_dim
        self.rotary = RotaryEmbedding(cfg.rope, dim, cfg.max_position_embeddings)
        self.rotary_local = (None if cfg.local_rope is None else
                             RotaryEmbedding(cfg.local_rope, dim, cfg.max_position_embeddings))

    @classmethod
    def arch_config(cls, name: str, cfg: dict) -> ArchConfig:
        """The engine's view of a config.json naming architecture ``name``."""
        return llama_like_config(name, cfg)

    def shard_sizes(self, param_name: str) -> list[int]:
        cfg = self.config
        if ".qkv_proj." in param_name:
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [param_name_inter(self, param_name)] * 2

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        x, residual = self.model.embed_tokens(tokens), None
        if self.config.scale_embeddings:  # sqrt(hidden) rounded to the weights' dtype
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        for i, (layer, cache) in enumerate(zip(self.model.layers, caches)):
            last = i == len(caches) - 1
            local = self.rotary_local is not None and layer.self_attn.window
            x, residual = layer(x, residual, positions,
                                self.rotary_local if local else self.rotary, cache, meta,
                                out_rows if last else None)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def param_name_inter(model: nn.Module, param_name: str) -> int:
    """The intermediate size of the fused gate/up weight ``param_name``."""
    return model.get_submodule(param_name.rsplit(".", 1)[0]).weight.shape[0] // 2
