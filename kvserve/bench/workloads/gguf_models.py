"""Bench models written straight to GGUF (``kvserve bench make-model NAME --format
gguf-...``): the sizes people run, which a float32 copy would not fit.

Each weight is drawn from its own seeded generator in row chunks and stored as
bfloat16, so the largest thing held at once is one tensor's bfloat16 values (the 8B
shape's 128k x 4096 embedding table, 1 GiB). The file is what llama.cpp's converter
writes for a Llama (or a Qwen3-MoE: q/k norms, a float32 router, each projection of all
experts in one tensor): its tensor names and metadata, the bench tokenizer's byte-level BPE
vocabulary padded with unused tokens up to the model's vocabulary (as the converter pads
a Hugging Face vocabulary), norms in float32. Q8_0 and Q4_K_M files are then made from
it by llama.cpp's own ``llama-quantize``: the same blocks, and the same mix of Q4_K and
Q6_K, as any Q4_K_M file people download.

The weights are random (std 0.02, norms 1): the files are for speed, not for text. q and
k are written as they are stored (llama.cpp's rotary layout), and every reader of the file
sees the same model.
"""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Iterator

import numpy as np

from kvserve.bench.workloads.models import BenchModelSpec, _special_ids_from_tokenizer_dir

# make-model's formats -> llama-quantize's type (None: the bfloat16 file as written)
GGUF_FORMATS = {"gguf-bf16": None, "gguf-q8_0": "Q8_0", "gguf-q4_k_m": "Q4_K_M",
                "gguf-q5_k_m": "Q5_K_M"}
# bench architectures -> llama.cpp's names for them
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3_moe": "qwen3moe"}
INIT_STD = 0.02
CHUNK_VALUES = 1 << 24  # random values drawn at a time


def _tensors(spec: BenchModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(llama.cpp name, shape as [experts x] rows x columns) of each weight, in the
    converter's order. Qwen3-MoE: q/k norms per head, a router, and each projection of
    all experts in one tensor."""
    head_dim = spec.hidden_size // spec.num_heads
    q, kv, h, ff = spec.num_heads * head_dim, spec.num_kv_heads * head_dim, \
        spec.hidden_size, spec.intermediate_size
    moe = spec.architecture == "qwen3_moe"
    yield "token_embd.weight", (spec.vocab_size, h)
    for i in range(spec.num_layers):
        yield f"blk.{i}.attn_norm.weight", (h,)
        yield f"blk.{i}.attn_q.weight", (q, h)
        yield f"blk.{i}.attn_k.weight", (kv, h)
        yield f"blk.{i}.attn_v.weight", (kv, h)
        yield f"blk.{i}.attn_output.weight", (h, q)
        if moe:
            yield f"blk.{i}.attn_q_norm.weight", (head_dim,)
            yield f"blk.{i}.attn_k_norm.weight", (head_dim,)
        yield f"blk.{i}.ffn_norm.weight", (h,)
        if moe:
            e = spec.num_experts
            yield f"blk.{i}.ffn_gate_inp.weight", (e, h)
            yield f"blk.{i}.ffn_gate_exps.weight", (e, ff, h)
            yield f"blk.{i}.ffn_up_exps.weight", (e, ff, h)
            yield f"blk.{i}.ffn_down_exps.weight", (e, h, ff)
            continue
        yield f"blk.{i}.ffn_gate.weight", (ff, h)
        yield f"blk.{i}.ffn_up.weight", (ff, h)
        yield f"blk.{i}.ffn_down.weight", (h, ff)
    yield "output_norm.weight", (h,)
    if not spec.tied_embeddings:
        yield "output.weight", (spec.vocab_size, h)


def _is_router(tensor: str) -> bool:
    """A MoE router's weight, kept in float32 as llama.cpp's converter keeps it."""
    return tensor.endswith(".ffn_gate_inp.weight")


def _float32_random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Normal(0, INIT_STD) values in float32 (a small tensor: drawn at once)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * INIT_STD).numpy()


def _bfloat16_random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Normal(0, INIT_STD) values as bfloat16 bit patterns (uint16), drawn in chunks."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK_VALUES):
        n = min(CHUNK_VALUES, flat.numel() - start)
        flat[start:start + n] = torch.randn(n, generator=gen) * INIT_STD
    return out.view(torch.int16).numpy().view(np.uint16)


def _vocabulary(tokenizer_dir: Path, vocab_size: int):
    """(tokens, token types, merges) of tokenizer_dir's byte-level BPE, padded with unused
    tokens to ``vocab_size``."""
    from gguf import TokenType

    tok = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_dir}/tokenizer.json: a GGUF bench model takes a BPE "
                         f"tokenizer, not {model.get('type')!r}")
    by_id = {i: t for t, i in model["vocab"].items()}
    kinds = {i: TokenType.NORMAL for i in by_id}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = TokenType.CONTROL if added.get("special") else \
            TokenType.USER_DEFINED
    if max(by_id) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(by_id)}, past the model's "
                         f"vocabulary of {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(int(kinds.get(i, TokenType.UNUSED)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def write_bfloat16_gguf(spec: BenchModelSpec, name: str, path: Path, tokenizer_dir: Path,
                        seed: int = 0, progress: bool = True) -> Path:
    """Write ``spec`` as a bfloat16 GGUF file at ``path``, one tensor at a time."""
    import gguf
    from tqdm import tqdm

    if spec.architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF bench models are {' or '.join(GGUF_ARCHITECTURES)}; {name} "
                         f"is {spec.architecture}")
    tokenizer_dir = Path(tokenizer_dir)
    special = _special_ids_from_tokenizer_dir(tokenizer_dir)
    tokens, types, merges = _vocabulary(tokenizer_dir, spec.vocab_size)
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHITECTURES[spec.architecture])
    writer.add_name(name)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_rope_dimension_count(spec.hidden_size // spec.num_heads)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    if spec.architecture == "qwen3_moe":
        writer.add_key_length(spec.hidden_size // spec.num_heads)
        writer.add_value_length(spec.hidden_size // spec.num_heads)
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_per_token)
        writer.add_expert_feed_forward_length(spec.intermediate_size)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for kind, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        if special[kind] is not None:
            add(special[kind])
    template = tokenizer_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
    shapes = list(_tensors(spec))
    for tensor, shape in shapes:
        if len(shape) == 1 or _is_router(tensor):
            writer.add_tensor_info(tensor, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            writer.add_tensor_info(tensor, shape, np.dtype(np.uint16), 2 * math.prod(shape),
                                   raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (tensor, shape) in enumerate(tqdm(shapes, desc=f"writing {path.name}",
                                                 unit="tensor", disable=not progress)):
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        elif _is_router(tensor):
            writer.write_tensor_data(_float32_random(shape, seed * 100_003 + index))
        else:
            writer.write_tensor_data(_bfloat16_random(shape, seed * 100_003 + index))
    writer.close()
    return path


def quantize_gguf(llama_quantize: str | Path, source: Path, out: Path, kind: str,
                  threads: int | None = None) -> Path:
    """``out``: ``source`` quantized to ``kind`` (Q8_0, Q4_K_M, ...) by llama-quantize."""
    cmd = [str(llama_quantize), str(source), str(out), kind]
    if threads:
        cmd.append(str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize {kind} failed (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return out


def make_gguf_bench_model(spec: BenchModelSpec, name: str, fmt: str, out: Path,
                          tokenizer_dir: Path, llama_quantize: str | Path | None = None
                          ) -> Path:
    """The bench model ``spec`` as the GGUF file ``out`` in ``fmt`` (GGUF_FORMATS)."""
    if fmt not in GGUF_FORMATS:
        raise ValueError(f"GGUF format {fmt!r}: one of {', '.join(GGUF_FORMATS)}")
    kind = GGUF_FORMATS[fmt]
    if kind is None:
        return write_bfloat16_gguf(spec, name, out, tokenizer_dir)
    if llama_quantize is None:
        raise ValueError(f"{fmt} is made by llama.cpp's llama-quantize: pass "
                         "--llama-quantize PATH")
    bf16 = out.with_name(out.name + ".bf16.tmp")
    try:
        write_bfloat16_gguf(spec, name, bf16, tokenizer_dir)
        return quantize_gguf(llama_quantize, bf16, out, kind)
    finally:
        bf16.unlink(missing_ok=True)
