"""The proposer interface: draft tokens for running requests, from their tokens alone."""
from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.request import Request


class Proposer(ABC):
    # what proposing costs: "request" (each request asked for drafts costs about the
    # same, whatever their number) or "pass" (each draft position is one pass of a
    # model over every request asked for that many: the k-th draft costs a pass)
    cost_unit = "request"

    @classmethod
    def from_config(cls, config, worker) -> Proposer:
        """Build from the EngineConfig (its ``speculative`` part is set) and the worker
        that runs the target (a proposer with a model asks it to load one)."""
        return cls()

    def pass_cost(self, num_requests: int) -> float | None:
        """Seconds of one pass over ``num_requests`` requests (``cost_unit`` "pass"), as
        the proposer measures it itself; None: the controller times the calls."""
        return None

    def catch_up_cost(self, request: Request) -> float:
        """Seconds this request's next drafts cost once, beyond the passes (a draft model
        computing the tokens it has not seen yet: its prompt, the first time)."""
        return 0.0

    @abstractmethod
    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        """Up to ``limits[request_id]`` guessed next tokens for each request named in
        ``limits``; a request may get none."""

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for requests that finished."""
