"""Tensor parallelism on one machine: ranks as processes, shared-memory collectives."""
