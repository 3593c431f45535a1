"""compressed-tensors checkpoints (as llmcompressor saves them): their quantization
config, their quantized layers read into the kernels' layouts, the W4A16 linear method
(W8A8 layers run :class:`~kvserve.model.quantization.Int8LinearMethod`)."""
from kvserve.model.compressed.checkpoint import Int8Weight, compressed_weights
from kvserve.model.compressed.linear import Int4LinearMethod, Int4Weight
from kvserve.model.compressed.scheme import CompressedConfig, Scheme, read_compressed_config

__all__ = ["CompressedConfig", "Int4LinearMethod", "Int4Weight", "Int8Weight", "Scheme",
           "compressed_weights", "read_compressed_config"]
