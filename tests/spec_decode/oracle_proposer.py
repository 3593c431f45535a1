"""A proposer for tests: it knows each prompt's greedy continuation and proposes it, with
every third position deliberately wrong, so steps accept some drafts and reject others
at every position, whatever the random model does."""
from __future__ import annotations

from kvserve.request import Request
from kvserve.spec_decode.proposer import Proposer


class OracleProposer(Proposer):
    continuations: dict[tuple[int, ...], list[int]] = {}  # prompt -> greedy output
    next_token: dict[tuple[int, ...], int] = {}  # whole context -> one draft (sampling)
    vocab: int = 512

    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        drafts = {}
        for req in requests:
            k = limits.get(req.request_id, 0)
            guess = self.next_token.get(tuple(req.prompt_token_ids + req.output_token_ids))
            if k and guess is not None:
                drafts[req.request_id] = [guess]
                continue
            known = self.continuations.get(tuple(req.prompt_token_ids))
            if not k or known is None:
                continue
            done = req.num_output_tokens
            guess = [t if (done + j) % 6 != 5 else (t + 1) % self.vocab
                     for j, t in enumerate(known[done:done + k])]
            if guess:
                drafts[req.request_id] = guess
        return drafts
