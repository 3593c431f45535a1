"""Draft model: a smaller model with the target's tokenizer guesses the next tokens
greedily, over its own paged KV pool.

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

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.core.kv.block_pool import BlockPool
from kvserve.model.config import ArchConfig
from kvserve.model.loader import MODEL_CLASSES
from kvserve.core.scheduler_output import SamplingInfo, ScheduledRequest
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.proposer import Proposer
from kvserve.worker.input_batch import build_inputs

_GREEDY = SamplingInfo(SamplingParams(temperature=0.0), (), (), None)


def _vocab(model_dir: Path) -> dict[str, int] | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("model", {}).get("vocab")


def check_draft_model(model: str, target) -> None:
    """Refuse a draft model that would not load or does not share the target's tokens
    (``target``: the target's ModelConfig)."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"speculative_config.model {model!r} is not a directory (a draft "
                         "model in Hugging Face layout, e.g. kvserve.default_draft_model_dir())")
    try:
        arch = ArchConfig.from_dir(path)
    except Exception as e:  # a bad or missing config.json, an unknown architecture
        raise ValueError(f"speculative_config.model {model!r} does not load: {e}") from None
    if arch.architecture not in MODEL_CLASSES:
        raise ValueError(f"speculative_config.model {model!r} is a {arch.architecture}; "
                         f"draft models may be {sorted(MODEL_CLASSES)}")
    if arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config.model {model!r} has a vocabulary of "
                         f"{arch.vocab_size} tokens, the target {target.arch.vocab_size}: a "
                         "draft model must use the target's tokenizer")
    mine, theirs = _vocab(path), _vocab(Path(target.model_dir))
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"speculative_config.model {model!r} has another tokenizer than the "
                         "target's (same size, other tokens): a draft model must use the "
                         "target's tokenizer")


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # the request's first tokens whose KV the draft holds


class DraftModelProposer(Proposer):
    cost_unit = "pass"

    def __init__(self, runner, num_blocks: int, block_size: int, max_positions: int,
                 max_requests: int = 1) -> None:
        """``runner``: a ModelRunner over the draft model and its own pool of
        ``num_blocks`` blocks (see ``Worker.create_draft_runner``)."""
        self.runner = runner
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_positions = max_positions
        self._states: dict[str, _DraftState] = {}
        # a pass's seconds by the requests in it, measured at start on one-token passes;
        # the controller scales it by what real passes take (the median of its recent
        # calls, so one slow pass does not lock drafting off; trials bring new ones)
        from kvserve.spec_decode.controller import ROW_GRID, StepCostModel
        grid = [n for n in ROW_GRID if n <= max(1, max_requests)] or [1]
        self.pass_model = StepCostModel(runner.time_decodes(grid) or {1: 0.0})
        # a catch-up of n tokens against one of a token: a prompt chunk through the draft
        self.prefill_model = StepCostModel(
            runner.time_rows(list(ROW_GRID), all_rows_sample=False) or {1: 0.0})

    @classmethod
    def from_config(cls, config, worker) -> DraftModelProposer:
        runner, num_blocks = worker.create_draft_runner(config.speculative.model)
        positions = min(runner.config.max_position_embeddings, config.model.max_model_len)
        return cls(runner, num_blocks, config.cache.block_size, positions,
                   config.scheduler.max_num_seqs)

    def pass_cost(self, num_requests: int) -> float:
        return self.pass_model(num_requests)

    def catch_up_cost(self, request: Request) -> float:
        state = self._states.get(request.request_id)
        pending = request.num_tokens - (state.cached if state is not None else 0)
        if pending <= 1:
            return 0.0
        return max(0.0, self.prefill_model(pending) - self.prefill_model(1))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        plan: list[tuple[Request, _DraftState, int]] = []  # (request, state, drafts)
        for req in requests:
            k = min(limits.get(req.request_id, 0), self.max_positions - req.num_tokens)
            if k <= 0:
                continue
            state = self._states.setdefault(req.request_id, _DraftState())
            state.cached = min(state.cached, req.num_tokens - 1)  # the last token gives logits
            if self._reserve(state, req.num_tokens + k - 1, limits):
                plan.append((req, state, k))
        if not plan:
            return {}
        with torch.inference_mode():
            guesses = self._catch_up(plan)
            drafts = {req.request_id: [g] for (req, _, _), g in zip(plan, guesses)}
            for depth in range(1, max(k for _, _, k in plan)):
                deeper = [(req, state) for req, state, k in plan if k > depth]
                scheduled = [ScheduledRequest(req.request_id, [drafts[req.request_id][-1]],
                                              req.num_tokens + depth - 1, state.blocks, _GREEDY)
                             for req, state in deeper]
                for (req, _), g in zip(deeper, self._greedy(scheduled)):
                    drafts[req.request_id].append(g)
        for req, state, _ in plan:
            state.cached = req.num_tokens
        return drafts

    def _catch_up(self, plan: list[tuple[Request, _DraftState, int]]) -> list[int]:
        """One pass over the tokens each request gained since its last drafts; each
        request's first guess."""
        return self._greedy([ScheduledRequest(req.request_id,
                                              req.token_slice(state.cached, req.num_tokens),
                                              state.cached, state.blocks, _GREEDY)
                             for req, state, _ in plan])

    def _greedy(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """Each scheduled request's argmax next token, in the order given (the flat
        batch puts decodes before prompt chunks)."""
        inputs = build_inputs(scheduled, self.block_size, self.runner.config.sliding_window,
                              self.runner.native_attention)
        best = self.runner.forward(inputs).argmax(dim=-1).tolist()
        by_id = {s.request_id: token for s, token in zip(inputs.sample_order, best)}
        return [by_id[s.request_id] for s in scheduled]

    def _reserve(self, state: _DraftState, slots: int, limits: dict[str, int]) -> bool:
        """Blocks for ``slots`` positions in the request's table; False when the pool
        cannot give them even after requests not asked this step gave theirs back."""
        need = -(-slots // self.block_size) - len(state.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            idle = [rid for rid, s in self._states.items()
                    if rid not in limits and s is not state]
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
