"""The draft model's side of speculative decoding: a runner over the draft model, its
own paged KV pool, and the greedy passes that guess the next tokens.

The draft keeps, per request, a block table in its own pool (blocks of the target's
size, from a :class:`~kvserve.core.kv.block_pool.BlockPool`) and how many of the
request's tokens its KV holds. Asked for k drafts it runs k passes, batched over the
requests asked: the first computes the tokens the request gained since the last time
(a prompt, or the accepted drafts and the token after them) and guesses from the last
one's logits; each further pass feeds the previous guess. Guesses' KV is written past
the tokens the request really has; afterwards the draft counts only the real tokens
as held, so the next call overwrites those slots, whatever the target accepted.

Invariant: a request's draft KV holds exactly its first ``cached`` tokens (positions
below ``cached``), and its table has a block for every slot a pass writes. When the
pool runs out, requests not asked this step give their blocks back first; a request
that still does not fit gets no drafts this step. A stop string that trims the output
leaves the tokens before the cut, so their KV stays valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.core.kv.block_pool import BlockPool
from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.worker_base import DraftAsk, DraftProposal

_GREEDY = SamplingInfo(SamplingParams(temperature=0.0), (), (), None)


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # the request's first tokens whose KV the draft holds


class DraftRunner:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        """``runner``: a ModelRunner over the draft model and its own pool of
        ``num_blocks`` blocks of ``block_size`` slots."""
        self.runner = runner
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._states: dict[str, _DraftState] = {}

    def propose(self, asks: list[DraftAsk]) -> DraftProposal:
        asked = {ask.request_id for ask in asks}
        plan: list[tuple[DraftAsk, _DraftState]] = []
        for ask in asks:
            state = self._states.setdefault(ask.request_id, _DraftState())
            state.cached = min(state.cached, ask.start)
            if self._reserve(state, ask.num_tokens + ask.num_drafts - 1, asked):
                plan.append((ask, state))
        drafts: dict[str, list[int]] = {}
        if plan:
            with torch.inference_mode():
                drafts = self._passes(plan)
            for ask, state in plan:
                state.cached = ask.num_tokens
        return DraftProposal(drafts, {rid: s.cached for rid, s in self._states.items()})

    def _passes(self, plan: list[tuple[DraftAsk, _DraftState]]) -> dict[str, list[int]]:
        guesses = self._catch_up(plan)
        drafts = {ask.request_id: [g] for (ask, _), g in zip(plan, guesses)}
        for depth in range(1, max(ask.num_drafts for ask, _ in plan)):
            deeper = [(ask, state) for ask, state in plan if ask.num_drafts > depth]
            scheduled = [ScheduledRequest(ask.request_id, [drafts[ask.request_id][-1]],
                                          ask.num_tokens + depth - 1, state.blocks, _GREEDY)
                         for ask, state in deeper]
            for (ask, _), g in zip(deeper, self._greedy(scheduled)):
                drafts[ask.request_id].append(g)
        return drafts

    def _catch_up(self, plan: list[tuple[DraftAsk, _DraftState]]) -> list[int]:
        """One pass over the tokens each request gained since its last drafts; each
        request's first guess."""
        return self._greedy([ScheduledRequest(ask.request_id,
                                              ask.token_ids[state.cached - ask.start:],
                                              state.cached, state.blocks, _GREEDY)
                             for ask, state in plan])

    def _greedy(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """Each scheduled request's argmax next token, in the order given (the flat
        batch puts decodes before prompt chunks)."""
        inputs = self.runner.step_inputs(scheduled)
        best = self.runner.forward(inputs).argmax(dim=-1).tolist()
        by_id = {s.request_id: token for s, token in zip(inputs.sample_order, best)}
        return [by_id[s.request_id] for s in scheduled]

    def _reserve(self, state: _DraftState, slots: int, asked: set[str]) -> bool:
        """Blocks for ``slots`` positions in the request's table; False when the pool
        cannot give them even after requests not asked this step gave theirs back."""
        need = -(-slots // self.block_size) - len(state.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            idle = [rid for rid, s in self._states.items()
                    if rid not in asked and s is not state]
            for rid in idle:
                self._release(rid)
                if need <= self.pool.num_free:
                    break
        if need > self.pool.num_free:
            return False
        state.blocks += self.pool.allocate(need, state.blocks[-1] if state.blocks else None)
        return True

    def _release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            for b in state.blocks:
                self.pool.decref(b)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._release(rid)

    def close(self) -> None:
        self.runner.close()
