"""Speculative decoding: proposers guess the next tokens of running requests, the step
verifies them (:mod:`kvserve.worker.rejection_sampler`), and a controller decides how
many guesses each request may carry so that speculation never costs throughput.

Proposers are registered here by ``speculative_config.method``, one line each.
"""
from __future__ import annotations

from kvserve.registry import Registry
from kvserve.spec_decode.draft_model import DraftModelProposer
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import Proposer

PROPOSERS: Registry[type[Proposer]] = Registry("speculative_config.method")
PROPOSERS.register("ngram", NgramProposer)
PROPOSERS.register("draft_model", DraftModelProposer)

__all__ = ["PROPOSERS", "Proposer", "NgramProposer", "DraftModelProposer"]
