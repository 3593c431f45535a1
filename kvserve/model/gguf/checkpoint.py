"""A GGUF file as a model directory: what the engine needs of a checkpoint, read from the
one file llama.cpp's tools write.

``prepare_gguf(path)`` makes (once per file, under ``$KVSERVE_CACHE_DIR/gguf``) a
directory with ``config.json`` and the tokenizer, which transformers' GGUF support
converts from the file's metadata (architecture, shapes, rope, vocabulary, merges, chat
template), and a marker naming the file and holding its tensor table (each tensor's name,
format, shape and place in the file: parsing the file's metadata, a vocabulary of 128k
strings, takes the gguf package seconds, so it is done once); the loader then reads the
weights from the file at those places (``gguf_weights``): each tensor dequantized by
``quants.py``, renamed to the Hugging Face name, and for the ``llama`` architecture with q
and k un-permuted (llama.cpp's converter interleaves each head's rotary halves;
transformers' layout keeps them apart). A mixture of experts keeps each projection of all
its experts in one tensor [experts, rows, columns]: each expert's rows are a weight of
their own, named as that expert's in a Hugging Face checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from kvserve.kernels.build import cache_root
from kvserve.model.gguf.linear import BlockWeight
from kvserve.model.gguf.quants import KEPT, dequantize

GGUF_MARKER = "kvserve_gguf.json"
PREPARED_FORMAT = 2  # what a prepared directory holds: a change makes them anew
MAGIC = b"GGUF"

# llama.cpp's tensor names -> Hugging Face's, for the Llama-family layouts
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "ffn_gate_inp": "mlp.gate"}
# a mixture of experts' projections, all experts in one tensor [experts, rows, columns]
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
            "ffn_down_exps": "down_proj"}
# tensors a file may carry that the model computes from its config instead
_DERIVED = ("rope_freqs.weight",)
# those tested against transformers on converted files
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def hf_name(name: str, expert: int | None = None) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None: not a known one); of an
    experts' tensor, expert ``expert``'s."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.{kind}"
    if match and match.group(2) in _EXPERTS and expert is not None:
        return (f"model.layers.{match.group(1)}.mlp.experts.{expert}."
                f"{_EXPERTS[match.group(2)]}.{kind}")
    return None


def _parts(tensor: dict) -> list[tuple[str | None, int, int, tuple[int, ...]]]:
    """(Hugging Face name or None, first byte, bytes, shape) of each weight a tensor of
    the marker's table holds: itself, or each expert's rows of an experts' tensor."""
    stem = tensor["name"].rpartition(".")[0]
    shape, start, nbytes = tuple(tensor["shape"]), tensor["offset"], tensor["bytes"]
    if stem.rpartition(".")[2] not in _EXPERTS or len(shape) != 3:
        return [(hf_name(tensor["name"]), start, nbytes, shape)]
    each = nbytes // shape[0]
    return [(hf_name(tensor["name"], e), start + e * each, each, shape[1:])
            for e in range(shape[0])]


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError("reading GGUF files needs the gguf package: pip install "
                         "'kvserve[gguf]'") from None
    return GGUFReader(str(path))


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def prepare_gguf(path: str | Path, root: Path | None = None) -> Path:
    """The model directory of the GGUF file ``path`` (made on first use), under ``root``
    (default: the cache's ``gguf`` folder)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{PREPARED_FORMAT}|{path}|{stat.st_size}|{stat.st_mtime_ns}"
                         .encode()).hexdigest()[:20]
    out = (cache_root() / "gguf" if root is None else Path(root)) / key
    if (out / GGUF_MARKER).is_file():
        return out
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        raise ValueError("a GGUF file's config and tokenizer are converted by transformers: "
                         "pip install 'kvserve[gguf]'") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".prepare-"))
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if "output.weight" not in names:  # the converter leaves a tied head out
            config.tie_word_embeddings = True
        config.architectures = [type(config).__name__.removesuffix("Config") + "ForCausalLM"]
        head_dim = _field(reader, f"{arch}.attention.key_length")
        if head_dim:  # transformers' conversion leaves Qwen3's at its config's default
            config.head_dim = int(head_dim)
        expert_rows = _field(reader, f"{arch}.expert_feed_forward_length")
        if expert_rows:  # nor does it read an expert's width
            config.moe_intermediate_size = int(expert_rows)
        if arch == "qwen3moe":  # llama.cpp's Qwen3-MoE renormalises the chosen experts'
            config.norm_topk_prob = True  # weights whatever the original config said
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        heads = _field(reader, f"{arch}.attention.head_count")
        (tmp / GGUF_MARKER).write_text(json.dumps({
            "file": str(path), "architecture": arch,
            "file_type": _field(reader, "general.file_type"),
            "heads": heads, "kv_heads": _field(reader, f"{arch}.attention.head_count_kv") or heads,
            "tensors": [_table_entry(t) for t in reader.tensors]}, indent=1))
        try:
            os.rename(tmp, out)
        except OSError:  # another process prepared it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def stored_format(model_dir: Path, activations: str) -> str | None:
    """How a prepared GGUF directory's weights are stored and multiplied (its file's
    ``general.file_type`` and the activations' rounding), what its kernels' speed depends
    on beyond the model's shape; None for any other model directory."""
    marker = model_dir / GGUF_MARKER
    if not marker.is_file():
        return None
    return f"gguf file_type {json.loads(marker.read_text()).get('file_type')}, {activations}"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a q or k projection's rows (each head's rows taken
    as pairs of its two rotary halves, interleaved)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _table_entry(tensor) -> dict:
    """A tensor of a GGUFReader as the marker records it (shape in torch's order)."""
    return {"name": tensor.name, "format": tensor.tensor_type.name,
            "shape": [int(n) for n in reversed(tensor.shape)],
            "offset": int(tensor.data_offset), "bytes": int(tensor.n_bytes)}


def _marker(model_dir: Path) -> tuple[Path, dict]:
    marker = json.loads((model_dir / GGUF_MARKER).read_text())
    path = Path(marker["file"])
    if not path.is_file():
        raise FileNotFoundError(f"the GGUF file {path} of {model_dir} is gone")
    return path, marker


def gguf_tensor_kinds(model_dir: Path) -> dict[str, str]:
    """Hugging Face name -> the file's storage format (``Q4_K``, ``F16``, ...) of each
    weight of the GGUF file a prepared directory names."""
    _, marker = _marker(model_dir)
    return {name: t["format"] for t in marker["tensors"] if t["name"] not in _DERIVED
            for name, *_ in _parts(t) if name is not None}


def gguf_weights(model_dir: Path, keep_blocks: Callable[[str], bool] = lambda name: False
                 ) -> Iterator[tuple[str, torch.Tensor | BlockWeight, str]]:
    """(Hugging Face name, values, the file's name) of each weight of the GGUF file a
    prepared directory names: float32 values, or, for a weight in a kept format (a block
    format, BF16 or F16) whose name ``keep_blocks`` accepts, its bytes as they are (a
    BlockWeight)."""
    path, marker = _marker(model_dir)
    arch, heads, kv_heads = marker["architecture"], marker["heads"], marker["kv_heads"]
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in marker["tensors"]:
        if tensor["name"] in _DERIVED:
            continue
        for name, start, nbytes, shape in _parts(tensor):
            if name is None:
                raise ValueError(f"{path.name}: tensor {tensor['name']!r} has no place in a "
                                 f"{arch} model")
            kind = tensor["format"]
            # the weight's bytes, copied out of the mapped file (the only copy made here)
            raw = torch.from_numpy(np.array(data[start:start + nbytes]))
            permuted = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
            if kind in KEPT and keep_blocks(name):
                weight = BlockWeight(kind, raw.reshape(shape[0], -1).contiguous(), shape[-1])
                if permuted:
                    order = _unpermute(torch.arange(shape[0]),
                                       heads if ".q_proj." in name else kv_heads)
                    weight = weight.permute_rows(order)
                yield name, weight, path.name
                continue
            values = dequantize(raw, kind, shape)
            if permuted:
                values = _unpermute(values, heads if ".q_proj." in name else kv_heads)
            yield name, values, path.name
