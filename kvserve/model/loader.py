"""Load a Hugging Face checkpoint directory: config, safetensors weights, dtype.

Safetensors only: a checkpoint that ships just pickled ``*.bin`` weights is refused,
because unpickling runs arbitrary code.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from kvserve.model.compressed import (CompressedConfig, Int4LinearMethod, compressed_weights,
                                     read_compressed_config)
from kvserve.model.compressed.scheme import stored_format as compressed_format
from kvserve.kernels.build import cpu_has_any
from kvserve.model.config import ArchConfig
from kvserve.model.gguf import GGUF_MARKER, gguf_tensor_kinds, gguf_weights
from kvserve.model.gguf.checkpoint import stored_format as gguf_format
from kvserve.model.gguf.linear import BlockEmbedding, BlockWeight, GGUFLinearMethod
from kvserve.model.gguf.quants import KEPT
from kvserve.model.layers import Linear
from kvserve.model.quantization import Int8LinearMethod, int8_matmul_is_exact, quantize_model
from kvserve.model.registry import MODELS

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 in hardware (AVX512-BF16 or AMX)."""
    return cpu_has_any("avx512_bf16", "amx_bf16")


def resolve_dtype(requested: str, model_config: ArchConfig, device: str = "cpu"
                  ) -> torch.dtype:
    """``auto``: on a GPU, float16 for a float16 checkpoint and bfloat16 for any other;
    on the CPU, the checkpoint's dtype if this CPU runs it fast, else float32 (see
    ``keeps_16bit_weights``)."""
    if requested != "auto":
        return _DTYPES[requested]
    wanted = _DTYPES.get(model_config.torch_dtype.replace("torch.", ""), torch.float32)
    if device == "cuda":
        return torch.float16 if wanted == torch.float16 else torch.bfloat16
    if wanted in (torch.bfloat16, torch.float16) and not cpu_has_bf16():
        logger.info("checkpoint dtype %s has no hardware support on this CPU: computing in "
                    "float32 on its 16-bit weights", model_config.torch_dtype)
        return torch.float32
    return wanted


def keeps_16bit_weights(requested: str, model_config: ArchConfig, device: str = "cpu",
                        quantization: str | None = None) -> bool:
    """Whether a 16-bit checkpoint's weights stay 16-bit, computed in float32: ``auto`` on
    a CPU without bf16 hardware. Decoding reads every weight each step, so two bytes a
    weight halve its time and the memory; the kernels widen them in registers (an
    explicit ``float32`` widens them all at load instead; ``--quantization`` quantizes
    float32 weights)."""
    return (requested == "auto" and device == "cpu" and quantization is None
            and model_config.torch_dtype.replace("torch.", "") in ("bfloat16", "float16")
            and resolve_dtype(requested, model_config, device) == torch.float32)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if others:
        return [model_dir / p for p in others]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(
            f"{model_dir} has only pickled weights (*.bin/*.pt); kvserve loads safetensors only "
            "(convert with transformers: save_pretrained(..., safe_serialization=True))")
    raise FileNotFoundError(
        f"{model_dir} has no model.safetensors, no model.safetensors.index.json and no "
        "*.safetensors shards")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), path


def stored_format(model_dir: Path, gguf_activations: str) -> str | None:
    """How a quantized checkpoint's weights are stored and multiplied (a GGUF file's type,
    a compressed-tensors scheme), what its kernels' speed depends on beyond the model's
    shape; None for a float checkpoint."""
    return gguf_format(model_dir, gguf_activations) or compressed_format(model_dir)


def _materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """The meta-device model's tensors as uninitialised memory on ``device`` (what
    Module.to_empty does, but by shape: torch's empty_like of a meta tensor imports its
    symbolic-shape machinery, half a second of start-up)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_model(model_dir: str | Path, model_config: ArchConfig, dtype: torch.dtype,
                quantization: str | None = None, tp=None,
                device: torch.device | str = "cpu", gguf_activations: str = "int8",
                weights_16bit: bool = False) -> nn.Module:
    """The checkpoint's model in ``dtype``, its linear layers quantized if asked; with
    ``tp`` (a TensorParallelGroup), this rank's share of it; its weights read straight
    into ``device``'s memory. ``gguf_activations``: ModelConfig.gguf_activations.
    ``weights_16bit`` (ModelConfig.weights_16bit): the linear layers and the token
    embedding the checkpoint stores in bfloat16 or float16 keep those bytes, as a GGUF
    file's BF16/F16 rows (the same layout), computed on by the same kernels."""
    model_dir = Path(model_dir)
    cls = MODELS[model_config.architecture]
    with torch.device("meta"):
        model = cls(model_config)
    if (model_dir / GGUF_MARKER).is_file():
        block_layers = _install_block_methods(model, gguf_tensor_kinds(model_dir))
        if block_layers and (tp is not None or quantization is not None):
            raise ValueError("a GGUF file's quantized weights are computed as they are: "
                             f"{'tensor parallelism' if tp is not None else '--quantization'} "
                             "is not supported with them")
        for layer in model.modules():
            if isinstance(getattr(layer, "method", None), GGUFLinearMethod):
                layer.method.int8_activations = gguf_activations == "int8"
        model = _materialize(model, device)
        _load_weights(model, gguf_weights(model_dir, keep_blocks=lambda name: checkpoint_target(
            model, name)[0] in block_layers), block_layers)
    elif (compressed := read_compressed_config(model_dir)) is not None:
        if tp is not None or quantization is not None:
            raise ValueError(f"a {compressed.describe()} checkpoint is computed as it is "
                             f"stored: {'tensor parallelism' if tp is not None else '--quantization'}"
                             " is not supported with it")
        files = weight_files(model_dir)
        quantized = _install_compressed_methods(model, compressed, files)
        kept = _install_16bit_methods(model, files, quantized) if weights_16bit else {}
        model = _materialize(model, device)
        rename = getattr(model, "checkpoint_name", lambda n: n)
        weights = compressed_weights(
            iter_weights(files), compressed,
            lambda module: checkpoint_target(model, rename(f"{module}.weight"))[0] in quantized)
        _load_weights(model, _as_16bit_rows(model, weights, kept), {**quantized, **kept})
    else:
        files = weight_files(model_dir)
        use_16bit = weights_16bit and tp is None and quantization is None
        kept = _install_16bit_methods(model, files) if use_16bit else {}
        model = _materialize(model, device)
        _load_weights(model, _as_16bit_rows(model, iter_weights(files), kept), kept)
    if hasattr(model, "make_rotaries"):  # buffers are not in checkpoints: made for real
        model.make_rotaries()
    if hasattr(model, "after_load"):  # what the model computes once from its weights
        model.after_load()
    if model_config.tie_word_embeddings and not isinstance(
            getattr(getattr(model, "model", None), "embed_tokens", None), BlockEmbedding):
        _tie(model)
    model = model.to(dtype).to(device)  # (the tables made anew above are made on the CPU)
    if tp is not None:
        from kvserve.model.tensor_parallel import shard_model
        shard_model(model, tp)
    if quantization is not None:
        quantize_model(model, quantization)
    model.eval()
    return model


def _tie(model: nn.Module) -> None:
    emb = model.get_submodule("model.embed_tokens" if hasattr(model, "model")
                              else "transformer.wte")
    model.lm_head.weight = emb.weight


def _install_block_methods(model: nn.Module, kinds: dict[str, str]
                           ) -> dict[str, Callable[[int | None, object], None]]:
    """Give each linear layer that a GGUF tensor in a block format loads into the linear
    method computing on the blocks, and a block-format token embedding a BlockEmbedding
    (a tied LM head then computes on its blocks), before any float weight is allocated.
    Returns, by checkpoint target, what loads the blocks there."""
    rename = getattr(model, "checkpoint_name", lambda n: n)
    loaders: dict[str, Callable[[int | None, object], None]] = {}
    tied = model.config.tie_word_embeddings
    for name, kind in kinds.items():
        target, shard = checkpoint_target(model, rename(name))
        module_name, _, attr = target.rpartition(".")
        if kind not in KEPT or attr != "weight" or target in loaders:
            continue
        layer = model.get_submodule(module_name)
        if isinstance(layer, nn.Embedding) and module_name == "model.embed_tokens":
            embedding = BlockEmbedding(layer.num_embeddings, layer.embedding_dim)
            model.model.embed_tokens = embedding
            head = model.lm_head if tied else None
            if head is not None:
                GGUFLinearMethod.install(head, [head.out_features])
            loaders[target] = functools.partial(_load_embedding, embedding, head)
        elif isinstance(layer, Linear) and not (module_name == "lm_head" and tied):
            rows = model.shard_sizes(target) if shard is not None else [layer.out_features]
            GGUFLinearMethod.install(layer, rows)
            loaders[target] = functools.partial(layer.method.load, layer)
    return loaders


_16BIT_KINDS = {"BF16": torch.bfloat16, "F16": torch.float16}


def _install_16bit_methods(model: nn.Module, files: list[Path], taken: dict | None = None
                           ) -> dict[str, Callable[[int | None, object], None]]:
    """The linear layers and token embedding whose checkpoint tensors are stored in
    bfloat16 or float16 (and not already ``taken`` by another method) computed on those
    16-bit rows, as a GGUF file's BF16/F16 tensors are. Returns what loads them."""
    transposed = tuple(getattr(model, "transposed_params", ()))
    kinds: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                if (piece.get_dtype() in _16BIT_KINDS and len(piece.get_shape()) == 2
                        and not name.endswith(transposed)):
                    kinds[name] = piece.get_dtype()
    rename = getattr(model, "checkpoint_name", lambda n: n)
    taken = taken or {}
    kinds = {n: k for n, k in kinds.items()
             if checkpoint_target(model, rename(n))[0] not in taken}
    return _install_block_methods(model, kinds)


def _as_16bit_rows(model: nn.Module, weights: Iterator[tuple[str, object, Path]],
                   kept: dict[str, Callable]) -> Iterator[tuple[str, object, Path]]:
    """The checkpoint's tensors, those loading into ``kept`` layers as 16-bit rows
    (BlockWeight of kind BF16/F16: the tensor's own bytes); a tied LM head's own copy
    is dropped where the head computes on the embedding's rows."""
    rename = getattr(model, "checkpoint_name", lambda n: n)
    tied = model.config.tie_word_embeddings and "model.embed_tokens.weight" in kept
    for name, tensor, path in weights:
        target = checkpoint_target(model, rename(name))[0]
        if tied and target == "lm_head.weight":
            continue
        if target in kept and isinstance(tensor, torch.Tensor):
            kind = next((k for k, d in _16BIT_KINDS.items() if d == tensor.dtype), None)
            if kind is not None:
                rows = tensor.contiguous()
                tensor = BlockWeight(kind, rows.view(torch.uint8), rows.shape[1])
        yield name, tensor, path


def _install_compressed_methods(model: nn.Module, config: CompressedConfig, files: list[Path]
                                ) -> dict[str, Callable[[int | None, object], None]]:
    """Give each linear layer the checkpoint stores quantized (the layers with a
    ``weight_scale``, or GPTQ and AWQ's ``qweight``) its scheme's linear method, before any
    float weight is allocated. Returns, by checkpoint target, what loads the layer's rows there."""
    rename = getattr(model, "checkpoint_name", lambda n: n)
    modules = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            modules.update(n.rpartition(".")[0] for n in f.keys()
                           if n.endswith("." + config.marker))
    loaders: dict[str, Callable[[int | None, object], None]] = {}
    schemes = {}
    for module in sorted(modules):
        scheme = config.scheme_for(module)
        target, shard = checkpoint_target(model, rename(f"{module}.weight"))
        layer = dict(model.named_modules()).get(target.rpartition(".")[0])
        if scheme is None or not isinstance(layer, Linear):
            raise ValueError(f"checkpoint quantizes {module}, which "
                             + ("its quantization_config does not name" if scheme is None
                                else f"is not a linear layer of {type(model).__name__}"))
        if target in schemes:
            if schemes[target] != scheme:
                raise ValueError(f"{target}: the parts of this fused layer are quantized "
                                 f"differently ({schemes[target]} and {scheme})")
            continue
        schemes[target] = scheme
        sizes = model.shard_sizes(target) if shard is not None else [layer.out_features]
        if scheme.kind == "w8a8":
            if not int8_matmul_is_exact(low=-128):
                raise ValueError("a W8A8 checkpoint needs an int8 matmul that sums exactly; "
                                 "torch._int_mm on this CPU does not (no VNNI int8 "
                                 "instructions?)")
            method = Int8LinearMethod.install_empty(layer)
        else:
            method = Int4LinearMethod.install(layer, scheme.group, scheme.act_order)
        loaders[target] = functools.partial(_load_rows, method, layer, sizes)
    return loaders


def _load_rows(method, layer: Linear, sizes: list[int], shard: int | None, weight) -> None:
    method.load(layer, sum(sizes[:shard or 0]), weight)


def _load_embedding(embedding: BlockEmbedding, head: Linear | None, shard, weight) -> None:
    embedding.load(weight)
    if head is not None:  # the same blocks, not a copy
        head.method.load(head, None, BlockWeight(embedding.kind, embedding.gguf_blocks,
                                                 embedding.embedding_dim, embedding)
                         if embedding.kind != "float" else embedding.gguf_blocks)


def _load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor, object]],
                  block_layers: dict[str, Callable[[int | None, object], None]] | None = None
                  ) -> None:
    """Copy (name, tensor, where it came from) into the model's parameters, or, for a
    target in ``block_layers``, hand it to what loads GGUF blocks there."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    rename = getattr(model, "checkpoint_name", lambda n: n)
    block_layers = block_layers or {}
    loaded_blocks: set[str] = set()
    for raw_name, tensor, path in weights:
        name = rename(raw_name)
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue  # buffers some checkpoints carry
        target, shard = checkpoint_target(model, name)
        if target in block_layers:
            try:
                block_layers[target](shard, tensor)
            except ValueError as e:
                raise ValueError(f"{Path(path).name}: tensor {raw_name!r}: {e}") from None
            loaded_blocks.add(target if shard is None else f"{target}#{shard}")
            continue
        if target not in params:
            raise ValueError(
                f"{Path(path).name}: tensor {raw_name!r} has no place in {type(model).__name__}")
        if any(name.endswith(s) for s in model.transposed_params):
            tensor = tensor.t()
        param = params[target]
        dest = param.data
        if shard is not None:
            sizes = model.shard_sizes(target)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{Path(path).name}: tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(model, params, loaded)
    unloaded = [name for name in block_layers
                if name not in loaded_blocks
                and not any(done.startswith(f"{name}#") for done in loaded_blocks)]
    if unloaded:
        raise ValueError(f"checkpoint is missing parts of {len(unloaded)} tensor(s): "
                         f"{', '.join(unloaded[:5])}")


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, int | None]:
    """The model's parameter a checkpoint tensor ``name`` (already renamed) loads into,
    and its shard there: q/k/v and gate/up go into the fused weights."""
    for frag, (fused, idx) in model.stacked_params.items():
        if frag in name:
            return name.replace(frag, fused), idx
    return name, None


def _check_complete(model: nn.Module, params: dict, loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            shards = len(model.shard_sizes(name))
            if any(f"{name}#{i}" not in loaded for i in range(shards)) and name not in loaded:
                missing.append(name)
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
