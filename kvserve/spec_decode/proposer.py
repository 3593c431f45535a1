"""The proposer interface: draft tokens for running requests, from their tokens alone."""
from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.request import Request


class Proposer(ABC):
    @classmethod
    def from_config(cls, config) -> Proposer:
        """Build from the SpeculativeConfig."""
        return cls()

    @abstractmethod
    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        """Up to ``limits[request_id]`` guessed next tokens for each request named in
        ``limits``; a request may get none."""

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for requests that finished."""
