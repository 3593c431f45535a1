"""Structured outputs: the output matches a JSON schema, a regex, a choice or a grammar,
token by token, through masks the sampler applies (llguidance)."""
from kvserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
