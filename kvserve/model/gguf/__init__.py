"""GGUF files (llama.cpp's format) as kvserve checkpoints.

``checkpoint.py`` turns a ``.gguf`` file into a model directory the engine loads like any
other (config.json and the tokenizer from the file's metadata, by transformers' GGUF
conversion) whose weights are read from the file itself; ``quants.py`` holds the block
formats' dequantization (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K); ``linear.py``
the linear method that computes on a quantized weight's blocks as the file stores them.
"""
from kvserve.model.gguf.checkpoint import (GGUF_MARKER, gguf_tensor_kinds, gguf_weights,
                                           is_gguf, prepare_gguf)

__all__ = ["GGUF_MARKER", "gguf_tensor_kinds", "gguf_weights", "is_gguf", "prepare_gguf"]
