"""A linear layer computed on a GGUF file's quantized blocks (the layer's linear method).

The file's bytes for the layer's weight stay as they are: one uint8 buffer per part of
the layer (``gguf_part0``, ... on the layer; q, k and v are three parts of a fused
qkv_proj, each in its own format, as a Q4_K_M file keeps some in Q6_K), never a float
copy (16-bit float weights too: BF16 and F16 stay two bytes a weight). A step of up to
``NATIVE_MAX_ROWS`` rows (decode) runs the native kernel, which
decodes each block in registers and uses it for every row
(``kvserve/kernels/gguf_linear.c``). A longer step (a prompt chunk) runs the same
kernels with the activations rounded as llama.cpp rounds them, where the format has
such a kernel (Q8_0 and the K formats: int8; BF16: bfloat16); otherwise it decodes ``TILE_ROWS`` weight rows at a time to float32 and multiplies them
with torch's GEMM, so the float copy is one tile, reused across all of the step's rows.
A part the file stores in F32 (llama.cpp keeps small tensors so) is a float buffer,
multiplied as is.

With the native kernels, a Q4_K, Q5_K or Q6_K part is rearranged once, when the layer is
configured, into runs of four rows (``Q4_K_X4``, ``Q5_K_X4``, ``Q6_K_X4``:
``kernels/gguf_k_x4.h`` and ``gguf_q6_k_x4.h``, the same bytes but for Q4_K's and Q5_K's
scales, one byte each), a Q8_0 part into runs of eight (``Q8_0_X8``,
``gguf_q8_0_x8.h``, the same bytes) and, with AVX512-BF16, a BF16 part into runs of
sixteen (``BF16_X16``, ``kernels/bf16_runs.c``: every row count, so a row's sums are the
same bits in a decode step as in a prompt chunk), so that an activation row is
multiplied with four, eight or sixteen weight rows per instruction; it goes back to the file's layout if configured
without them. A part whose blocks the token embedding shares (a tied LM head) is
rearranged with the embedding, which then unpacks the runs holding the rows it looks up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.gguf.quants import KEPT, dequantize
from kvserve.model.linear_method import LinearMethod

# the native kernels' codes for the block formats (kvserve/kernels/gguf_linear.c)
FORMAT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "BF16": 5, "F16": 6,
                "Q4_K_X4": 7, "Q5_K_X4": 8, "Q6_K_X4": 9, "Q8_0_X8": 10, "BF16_X16": 11}
# a file's format -> its runs of rows, and the rows of a run
IN_RUNS = {"Q4_K": "Q4_K_X4", "Q5_K": "Q5_K_X4", "Q6_K": "Q6_K_X4", "Q8_0": "Q8_0_X8",
           "BF16": "BF16_X16"}
FROM_RUNS = {runs: kind for kind, runs in IN_RUNS.items()}
RUN_ROWS = {"Q4_K_X4": 4, "Q5_K_X4": 4, "Q6_K_X4": 4, "Q8_0_X8": 8, "BF16_X16": 16}
RUNS_MAX_COLS = 16384  # the longest rows the runs take
NATIVE_MAX_ROWS = 8
TILE_ROWS = 256


@dataclass
class BlockWeight:
    """A weight as a GGUF file stores it: ``blocks`` [rows, bytes a row] uint8 of
    ``kind`` (one of ``KEPT``), holding ``rows`` x ``cols`` values."""
    kind: str
    blocks: torch.Tensor
    cols: int
    embedding: BlockEmbedding | None = None  # a token embedding reading the same blocks

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def permute_rows(self, order: torch.Tensor) -> BlockWeight:
        """The same weight with its rows in ``order`` (whole rows are whole blocks)."""
        return BlockWeight(self.kind, self.blocks[order].contiguous(), self.cols)

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        part = self.blocks[start:stop]
        return dequantize(part, self.kind, (part.shape[0], self.cols))


class GGUFLinearMethod(LinearMethod):
    """``shard_rows``: the output rows of each part, in the layer's column order (one
    part for a plain layer)."""

    def __init__(self, shard_rows: list[int]) -> None:
        self.shard_rows = list(shard_rows)
        self.kinds: list[str | None] = [None] * len(shard_rows)
        # the token embedding that reads a part's blocks (a tied LM head's), by part
        self.embeddings: list[BlockEmbedding | None] = [None] * len(shard_rows)
        self.repacked_by = None  # the kernels that made the parts in runs of rows
        self.native = None  # kvserve.kernels.Kernels, when configured with them
        # rows (decode and prompt) rounded as llama.cpp rounds them: to int8 and
        # multiplied in integers (Q8_0 and K-format parts, AVX2), to bfloat16 against
        # BF16 parts; False: in float, which equals dequantize-then-multiply up to float
        # rounding
        self.int8_activations = True

    @classmethod
    def install(cls, layer: nn.Linear, shard_rows: list[int]) -> GGUFLinearMethod:
        """Give ``layer`` (on the meta device, before its weights load) this method: its
        float weight is dropped, the parts are loaded with ``load``."""
        if sum(shard_rows) != layer.out_features:
            raise ValueError(f"parts of {shard_rows} rows do not make {layer.out_features}")
        layer.register_parameter("weight", None)
        layer.method = method = cls(shard_rows)
        return method

    def load(self, layer: nn.Linear, shard: int | None, weight: BlockWeight | torch.Tensor
             ) -> None:
        """Part ``shard`` (None: the whole layer) from the file: blocks, or float values."""
        index = 0 if shard is None else shard
        rows, cols = self.shard_rows[index], layer.in_features
        if isinstance(weight, BlockWeight):
            got, kind, data = (weight.rows, weight.cols), weight.kind, weight.blocks
            self.embeddings[index] = weight.embedding
        else:
            got, kind, data = tuple(weight.shape), "float", weight.detach().float().contiguous()
        if got != (rows, cols):
            raise ValueError(f"a weight of shape {got} does not fit part {index} "
                             f"({rows}, {cols}) of this layer")
        self.kinds[index] = kind
        layer.register_buffer(f"gguf_part{index}", data.to(self._device(layer)))

    @staticmethod
    def _device(layer: nn.Linear) -> torch.device:
        bias = layer.bias
        return bias.device if bias is not None and not bias.is_meta else torch.device("cpu")

    def missing_parts(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind is None]

    def configure(self, layer: nn.Linear, mode) -> None:
        kernels = getattr(mode, "kernels", None)
        self.native = kernels if kernels is not None and kernels.available else None
        self._relayout(layer)

    def _relayout(self, layer: nn.Linear) -> None:
        """Q4_K, Q5_K, Q6_K, Q8_0 and BF16 parts in runs of rows with the native kernels
        (where they have the layout), and back without them; an embedding sharing a part
        follows it."""
        cols = layer.in_features
        for i, (kind, rows) in enumerate(zip(self.kinds, self.shard_rows)):
            data = getattr(layer, f"gguf_part{i}")
            if (kind in IN_RUNS and self.native is not None and data.device.type == "cpu"
                    and rows % RUN_ROWS[IN_RUNS[kind]] == 0 and cols <= RUNS_MAX_COLS):
                repacked = self.native.gguf_repack_runs(data, kind, cols)
                if repacked is not None:
                    self.repacked_by = self.native
                    self._replace(layer, i, IN_RUNS[kind], repacked)
            elif kind in FROM_RUNS and self.native is None:
                self._replace(layer, i, FROM_RUNS[kind], self.repacked_by.gguf_repack_runs(
                    data, FROM_RUNS[kind], cols, unpack=True))

    def _replace(self, layer: nn.Linear, index: int, kind: str, data: torch.Tensor) -> None:
        layer.register_buffer(f"gguf_part{index}", data)
        self.kinds[index] = kind
        if self.embeddings[index] is not None:
            self.embeddings[index].relayout(kind, data, self.repacked_by)

    def parts(self, layer: nn.Linear):
        """(first output column, rows, kind, buffer) of each part."""
        start = 0
        for i, (rows, kind) in enumerate(zip(self.shard_rows, self.kinds)):
            yield start, rows, kind, getattr(layer, f"gguf_part{i}")
            start += rows

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float().contiguous()
        out = x.new_empty((x.shape[0], layer.out_features))
        for start, rows, kind, data in self.parts(layer):
            cols = out[:, start:start + rows]
            if kind == "float":
                cols.copy_(F.linear(x, data.to(x.dtype)))
            elif self.native is None or x.device.type != "cpu":
                self._tiled(x, kind, data, layer.in_features, cols)
            elif x.shape[0] <= NATIVE_MAX_ROWS:
                self.native.gguf_rows(x, data, FORMAT_CODES[kind], cols, self.int8_activations)
            elif not (self.int8_activations
                      and self.native.gguf_rows_int8(x, data, FORMAT_CODES[kind], cols)):
                self._tiled(x, kind, data, layer.in_features, cols)
        if layer.bias is not None:
            out += layer.bias.float()
        return out if dtype == torch.float32 else out.to(dtype)

    def _tiled(self, x: torch.Tensor, kind: str, blocks: torch.Tensor, cols: int,
               out: torch.Tensor) -> None:
        """out = x @ W.T a tile of TILE_ROWS weight rows at a time, each decoded once."""
        for start in range(0, blocks.shape[0], TILE_ROWS):
            tile = blocks[start:start + TILE_ROWS]
            if self.native is not None and tile.device.type == "cpu":
                w = self.native.gguf_dequantize(tile, FORMAT_CODES[kind], cols)
            else:
                w = dequantize(tile, kind, (tile.shape[0], cols)).to(x.device)
            out[:, start:start + tile.shape[0]] = F.linear(x, w)


def is_block_kind(kind: str) -> bool:
    return kind in KEPT


class BlockEmbedding(nn.Module):
    """A token embedding kept as the file's blocks: a lookup decodes the rows it reads.
    A tied LM head computes on the same blocks (GGUFLinearMethod), which its method may
    rearrange in runs of rows: a lookup then unpacks the runs it reads first."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.kind: str | None = None
        self.runs_kernels = None  # the kernels that unpack the runs (kind in FROM_RUNS)
        # no values: follows the model's dtype through .to(), so lookups return that dtype
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    def load(self, weight: BlockWeight | torch.Tensor) -> None:
        if isinstance(weight, BlockWeight):
            got, self.kind, data = (weight.rows, weight.cols), weight.kind, weight.blocks
        else:
            got, self.kind, data = tuple(weight.shape), "float", weight.detach().float()
        if got != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"an embedding of shape {got} does not fit "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        self.register_buffer("gguf_blocks", data.contiguous())

    def relayout(self, kind: str, blocks: torch.Tensor, kernels) -> None:
        """The shared blocks as the LM head's method rearranged them (``kind``)."""
        self.register_buffer("gguf_blocks", blocks)
        self.kind, self.runs_kernels = kind, kernels

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat, kind = tokens.reshape(-1), self.kind
        if kind in FROM_RUNS:  # the runs holding the tokens' rows, unpacked
            per_run = RUN_ROWS[kind]
            kind, first = FROM_RUNS[kind], flat - flat % per_run
            runs = self.gguf_blocks[(first[:, None] + torch.arange(per_run)).reshape(-1)]
            rows = self.runs_kernels.gguf_repack_runs(runs, kind, self.embedding_dim,
                                                      unpack=True)
            rows = rows[torch.arange(flat.shape[0]) * per_run + flat % per_run]
        else:
            rows = self.gguf_blocks[flat]
        values = rows if kind == "float" else dequantize(
            rows, kind, (rows.shape[0], self.embedding_dim))
        return values.to(self.dtype_probe.dtype).reshape(*tokens.shape, self.embedding_dim)
