"""CapturedStep: a few-row step of a Llama-family model as one native call.

The CPU form of capturing a decode step's graph: what the eager forward does per layer
through a dozen Python calls runs in C (``kernels/decode_step.c``), over a plan of the
model's weight and KV pool addresses built once here. Only the dispatch goes; the
kernels and their order are those of the eager path with its linear layers on the
native few-row GEMV (over the panels, where every layer's GEMV reads them), so the logits are
bitwise that path's. (Eager as it runs takes
oneDNN or torch for some layers and row counts, whose sums round differently.)

Invariant: the model's weights and the KV pools are never rebound after start (the
loader, ``configure_layers`` and the KV tiers all write in place), so the plan's
addresses stay valid for the runner's life; the plan keeps every tensor it names alive.

It covers a step when every row gives logits (decodes and draft verification; no
prefill chunk, no prompt logprobs) and the rows are at most ``max_rows``, which the
worker sets by timing both paths at start (:func:`choose_captured_rows`). A step of
decodes alone skips the StepInputs too (:meth:`CapturedStep.decode`): its inputs go
straight into a buffer kept from start. The model it takes: LlamaForCausalLM (Llama,
Mistral, Qwen2), Qwen3ForCausalLM (each q and k head RMSNormed in place before rotary,
as its eager attention does natively) or Qwen3MoeForCausalLM (the router's float32
weight read by the same native routing as the eager SparseMoE's, each chosen expert run
over its rows in expert order, as eager) in float32 with a float32 KV pool and SiLU MLPs, on one rank,
unquantized, or with every linear layer on a GGUF file's blocks (the same kernels as
GGUFLinearMethod's, its embedding decoded a row at a time as BlockEmbedding's).
``--enforce-eager`` (vLLM's flag) turns it off.
"""
from __future__ import annotations

import statistics

import numpy as np
import torch

from kvserve.model.attention import KVCache
from kvserve.model.gguf.linear import FORMAT_CODES, BlockEmbedding, GGUFLinearMethod
from kvserve.model.layers import Linear
from kvserve.model.linear_method import FloatLinearMethod
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.moe import SparseMoE
from kvserve.model.moe_models import Qwen3MoeForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.worker.input_batch import StepInputs, decode_fields, decodes_only

MAX_ROWS = 8     # the native GEMV reads the weights once for up to eight rows
REQUIRED_GAIN = 0.02  # a row count stays eager only where eager measured this much faster
# the row counts timed at start-up: powers of two, so a model whose step takes a second
# (an 8B model on two cores) is timed on 15 rows' steps a mode and round, not 36; a step
# of rows between two of them costs between theirs
TIMED_ROWS = tuple(2 ** i for i in range(MAX_ROWS.bit_length()) if 2 ** i <= MAX_ROWS)


def _mlps(layer) -> list:
    """A layer's gated MLPs: itself, or a mixture's experts."""
    return list(layer.mlp.experts) if isinstance(layer.mlp, SparseMoE) else [layer.mlp]


def _linears(model) -> list:
    """Every linear layer the step multiplies by (a router's weight is read as is)."""
    return [model.lm_head] + [m for layer in model.model.layers
                              for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                        *(p for mlp in _mlps(layer)
                                          for p in (mlp.gate_up_proj, mlp.down_proj)))]


def unsupported_reason(model, caches: list[KVCache], kernels) -> str | None:
    """Why the captured step cannot run this model (None: it can)."""
    if kernels is None:
        return "no native kernels"
    if not isinstance(model, (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)):
        return (f"{type(model).__name__}: the captured step runs Llama, Mistral, Qwen2, "
                "Qwen3 and Qwen3-MoE layers only")
    for layer in model.model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE) and (
                mlp.shared_expert is not None or mlp.router_weight() is None
                or any(p.bias is not None for e in mlp.experts
                       for p in (e.gate_up_proj, e.down_proj))):
            return ("a shared expert, experts with biases, or a router weight that is not "
                    "float32 in memory")
    cfg = model.config
    if cfg.qk_norm not in (None, "head") or cfg.rotary_dim not in (None, cfg.head_dim):
        return "q/k norms over whole projections, or a partial rotary"
    linears = _linears(model)
    if any(type(m) is not Linear for m in linears):
        return "sharded linear layers"
    gguf = [m for m in linears if isinstance(m.method, GGUFLinearMethod)]
    if gguf:
        if len(gguf) != len(linears):
            return "GGUF layers beside others"
        if any(kind not in FORMAT_CODES for m in gguf for kind in m.method.kinds):
            return "a GGUF layer the file stores in a float format"
    elif any(not isinstance(m.method, FloatLinearMethod) for m in linears):
        return "quantized linear layers"
    if type(model.model.embed_tokens) not in (torch.nn.Embedding, BlockEmbedding):
        return "a quantized token embedding"
    if any(getattr(layer.self_attn, "tp", None) or getattr(layer.mlp, "tp", None)
           for layer in model.model.layers):
        return "tensor parallel"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "weights are not float32"
    if any(c.k.dtype != torch.float32 for c in caches):
        return "the KV cache is not float32"
    if not all(t.is_contiguous() for t in [*model.parameters(), *model.rotary.buffers(),
                                           *(x for c in caches for x in (c.k, c.v))]):
        return "a weight or KV pool is not contiguous"
    if len(caches) != len(model.model.layers):
        return "the KV pools are not one per layer"
    if not all(mlp.act.is_silu for layer in model.model.layers for mlp in _mlps(layer)):
        return "the MLP activation is not SiLU"
    return None


class CapturedStep:
    # the plan's layout: kernels/decode_step.c's PLAN_HEADER and LAYER_FIELDS
    HEADER = ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "block",
              "window", "panels", "embed", "final_norm", "lm_head", "lm_bias", "cos", "sin",
              "gguf", "embed_fmt", "head_norms", "moe_experts", "moe_top_k", "moe_norm",
              "moe_inter", "moe_counts")
    LAYER = ("in_norm", "qkv_w", "qkv_b", "o_w", "o_b", "post_norm", "gate_up_w",
             "gate_up_b", "down_w", "down_b", "k_pool", "v_pool", "q_norm", "k_norm",
             "router", "experts")

    def __init__(self, model: LlamaForCausalLM, caches: list[KVCache], kernels) -> None:
        reason = unsupported_reason(model, caches, kernels)
        if reason:
            raise ValueError(f"the captured step cannot run this model: {reason}")
        cfg = model.config
        self.kernels = kernels
        self.max_rows = 0  # set by measurement; 0: every step eager
        self.start_times: dict[int, tuple[float, float]] = {}  # rows: (eager, captured) s
        self.profiler = None  # a StepProfiler, told the parts of the steps it times
        self.vocab = cfg.vocab_size
        self.block_size = caches[0].block_size
        self.eps = float(cfg.norm_eps)
        self.scale = float(model.model.layers[0].self_attn.scale)
        # the GEMVs read the panels when every layer's GEMV does (as eager's native
        # GEMV then does: the same sums), else every dense weight, or every GGUF layer's
        # blocks
        self.gguf = isinstance(model.lm_head.method, GGUFLinearMethod)
        self.on_panels = not self.gguf and all(m.method.gemv_on_panels
                                               for m in _linears(model))
        weight = (self._gguf_layer if self.gguf else
                  (lambda m: m.method.panel_weight) if self.on_panels else (lambda m: m.weight))
        # the plan holds addresses: keep every tensor it names alive and in place
        self._tensors: list[torch.Tensor] = []
        embedding = model.model.embed_tokens
        blocks = embedding.kind != "float" if isinstance(embedding, BlockEmbedding) else False
        table = embedding.gguf_blocks if isinstance(embedding, BlockEmbedding) \
            else embedding.weight
        # each MoE layer's experts run and tokens routed, added up by the steps
        self.moe_counts = torch.zeros((cfg.num_layers, 2), dtype=torch.int64)
        header = {
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "inter": cfg.intermediate_size, "vocab": cfg.vocab_size,
            "block": caches[0].block_size, "window": cfg.sliding_window or 0,
            "panels": int(self.on_panels),
            "embed": self._address(table),
            "final_norm": self._address(model.model.norm.weight),
            "lm_head": self._address(weight(model.lm_head)),
            "lm_bias": self._address(model.lm_head.bias),
            "cos": self._address(model.rotary.cos), "sin": self._address(model.rotary.sin),
            "gguf": int(self.gguf), "embed_fmt": FORMAT_CODES[embedding.kind] if blocks else -1,
            "head_norms": int(cfg.qk_norm == "head"),
            "moe_experts": cfg.num_experts or 0, "moe_top_k": cfg.num_experts_per_tok or 0,
            "moe_norm": int(bool(cfg.norm_topk_prob)),
            "moe_inter": cfg.moe_intermediate_size or 0,
            "moe_counts": self._address(self.moe_counts)}
        plan = [header[name] for name in self.HEADER]
        for index, (layer, cache) in enumerate(zip(model.model.layers, caches)):
            attn, mlp = layer.self_attn, layer.mlp
            moe = isinstance(mlp, SparseMoE)
            if moe:  # the layer's counts read where the bench counts the eager ones
                mlp.captured_counts = self.moe_counts[index]
            experts = torch.tensor([self._address(weight(p)) for e in _mlps(layer)
                                    for p in (e.gate_up_proj, e.down_proj)],
                                   dtype=torch.int64) if moe else None
            fields = {
                "in_norm": layer.input_layernorm.weight, "qkv_w": weight(attn.qkv_proj),
                "qkv_b": attn.qkv_proj.bias, "o_w": weight(attn.o_proj),
                "o_b": attn.o_proj.bias, "post_norm": layer.post_attention_layernorm.weight,
                "gate_up_w": None if moe else weight(mlp.gate_up_proj),
                "gate_up_b": None if moe else mlp.gate_up_proj.bias,
                "down_w": None if moe else weight(mlp.down_proj),
                "down_b": None if moe else mlp.down_proj.bias,
                "router": mlp.router_weight() if moe else None, "experts": experts,
                "k_pool": cache.k, "v_pool": cache.v,
                "q_norm": attn.q_norm.weight if cfg.qk_norm == "head" else None,
                "k_norm": attn.k_norm.weight if cfg.qk_norm == "head" else None}
            plan += [self._address(fields[name]) for name in self.LAYER]
        self.plan = torch.tensor(plan, dtype=torch.int64)
        self._timings = torch.zeros(2, dtype=torch.float64)
        # A decode step's inputs, written in place, and its logits, a view per row count:
        # right after a step, each torch call costs many times its warm price.
        self._max_blocks = -(-cfg.max_position_embeddings // header["block"])
        self._ints = np.zeros(MAX_ROWS * (4 + self._max_blocks), dtype=np.int64)
        logits = torch.empty(MAX_ROWS, self.vocab, dtype=torch.float32)
        self._logits = [logits[:n] for n in range(MAX_ROWS + 1)]
        # addresses taken once: each data_ptr() is a torch call
        self._plan_at, self._ints_at = self.plan.data_ptr(), self._ints.ctypes.data
        self._logits_at, self._timings_at = logits.data_ptr(), self._timings.data_ptr()

    def _address(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the captured step needs contiguous weights and pools in memory "
                             f"(a dense weight let go has none); got one on {t.device}")
        self._tensors.append(t.detach())  # its storage, kept even if the Parameter is rebound
        return t.data_ptr()

    def _gguf_layer(self, layer: Linear) -> torch.Tensor:
        """A GGUF layer as the kernel reads it: its part count, whether its activations
        are rounded to int8, then each part's blocks' address, format and rows."""
        desc = [0, int(layer.method.int8_activations)]
        for _, rows, kind, data in layer.method.parts(layer):
            desc += [self._address(data), FORMAT_CODES[kind], rows]
            desc[0] += 1
        return torch.tensor(desc, dtype=torch.int64)

    def covers(self, inputs: StepInputs) -> bool:
        """Whether this step runs captured: few enough rows, every one giving logits."""
        rows = inputs.tokens.shape[0]
        return (rows <= self.max_rows and inputs.prompt_rows is None
                and inputs.meta.native is not None and inputs.sample_rows.shape[0] == rows)

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits [rows, vocab], rows in the flat batch's order (which, for a
        covered step, is the order of ``inputs.sample_rows``)."""
        meta = inputs.meta
        rows = inputs.tokens.shape[0]
        logits = torch.empty((rows, self.vocab), dtype=torch.float32)
        tables = meta.row_block_tables
        self._run(rows, inputs.tokens.data_ptr(), inputs.positions.data_ptr(),
                  meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
                  meta.row_seq_lens.data_ptr(), logits.data_ptr())
        return logits

    def decode(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """The logits [rows, vocab] of a step of requests each decoding one token, rows
        in ``scheduled``'s order, with no StepInputs built; None when this step does not
        cover it. The logits are this object's, overwritten by the next call."""
        rows = len(scheduled)
        if not 0 < rows <= self.max_rows or not decodes_only(scheduled):
            return None
        f = decode_fields(scheduled, self.block_size)
        if f.width > self._max_blocks:
            return None
        # one write in place: tokens, positions, slots, seq_lens (one per row each), then
        # the tables; the kernel reads each at its offset
        ints = f.tokens + f.positions + f.slots + f.seq_lens
        for table in f.tables:
            ints += table
        self._ints[:len(ints)] = ints
        tokens, positions, slots, seq_lens, tables = (
            self._ints_at + 8 * rows * i for i in range(5))
        self._run(rows, tokens, positions, slots, tables, f.width, seq_lens, self._logits_at)
        return self._logits[rows]

    def _run(self, rows: int, tokens: int, positions: int, slots: int, tables: int,
             table_stride: int, seq_lens: int, logits: int) -> None:
        """The native step on inputs at these addresses (int64, tables' rows
        ``table_stride`` apart), its linear and attention seconds to the profiler when
        it times this step."""
        timed = self.profiler is not None and self.profiler.active
        if timed:
            self._timings.zero_()
        self.kernels.captured_step(
            self._plan_at, tokens, positions, slots, tables, table_stride, seq_lens, rows,
            self.eps, self.scale, logits, self._timings_at if timed else 0)
        if timed:
            linear, attention = self._timings.tolist()
            self.profiler.add("linear", linear)
            self.profiler.add("attention", attention)


def choose_captured_rows(runner, captured: CapturedStep, rounds: int = 3) -> dict[int, tuple]:
    """Time decode steps of TIMED_ROWS requests eager and captured, in alternating
    rounds (a drifting machine then slows both alike); ``max_rows`` becomes the largest
    timed count up to which eager's median was nowhere faster by REQUIRED_GAIN. A tie goes
    to the captured step: it reads the same weights without Python between the layers, a
    gain a start-up step of a bandwidth-bound model (a 1B BF16 GGUF: 105 ms either way)
    hides and steady decoding shows (95 against 140 ms). Returns
    {rows: (eager s, captured s)}."""
    counts = list(TIMED_ROWS)
    samples: dict[int, dict[int, list[float]]] = {0: {}, MAX_ROWS: {}}
    try:
        for r in range(rounds):
            for max_rows in ((0, MAX_ROWS) if r % 2 == 0 else (MAX_ROWS, 0)):
                captured.max_rows = max_rows
                # one step each, no warm-up step: a slow first call of a path is one
                # sample of a count's median over the rounds
                for n, t in runner.time_decodes(counts, rounds=1, warm=False).items():
                    samples[max_rows].setdefault(n, []).append(t)
    finally:
        captured.max_rows = 0  # eager unless the measurement below completes
    eager, fast = ({n: statistics.median(v) for n, v in samples[m].items()} for m in (0, MAX_ROWS))
    chosen = 0
    for n in counts:
        if n not in eager or n not in fast or eager[n] < (1 - REQUIRED_GAIN) * fast[n]:
            break
        chosen = n
    captured.max_rows = chosen
    captured.start_times = {n: (eager[n], fast[n]) for n in counts if n in eager and n in fast}
    return captured.start_times
