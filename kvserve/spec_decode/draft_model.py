"""Draft model: a smaller model with the target's tokenizer guesses the next tokens
greedily. It runs in the worker, next to the target, over its own paged KV pool
(:mod:`kvserve.worker.draft_runner`); this proposer asks the worker for drafts and keeps
what the worker reports of the draft's KV (how many of each request's tokens it holds),
to send each request only the tokens the draft has not seen and to price its catch-up.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.model.registry import MODELS, read_arch_config
from kvserve.request import Request
from kvserve.spec_decode.proposer import Proposer
from kvserve.worker.worker_base import DraftAsk, DraftModelInfo


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
        arch = read_arch_config(path)
    except Exception as e:  # a bad or missing config.json, an unknown architecture
        raise ValueError(f"speculative_config.model {model!r} does not load: {e}") from None
    if arch.architecture not in MODELS:
        raise ValueError(f"speculative_config.model {model!r} is a {arch.architecture}; "
                         f"draft models may be {sorted(MODELS.names())}")
    if arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config.model {model!r} has a vocabulary of "
                         f"{arch.vocab_size} tokens, the target {target.arch.vocab_size}: a "
                         "draft model must use the target's tokenizer")
    mine, theirs = _vocab(path), _vocab(Path(target.model_dir))
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"speculative_config.model {model!r} has another tokenizer than the "
                         "target's (same size, other tokens): a draft model must use the "
                         "target's tokenizer")


class DraftModelProposer(Proposer):
    cost_unit = "pass"

    def __init__(self, worker, info: DraftModelInfo, max_requests: int = 1) -> None:
        """``worker``: the worker that loaded the draft model (``info``)."""
        self.worker = worker
        self.max_positions = info.max_positions
        self._held: dict[str, int] = {}  # request -> its first tokens the draft's KV holds
        # a pass's seconds by the requests in it, measured at start on one-token passes;
        # the controller scales it by what real passes take (the median of its recent
        # calls, so one slow pass does not lock drafting off; trials bring new ones); a
        # catch-up of n tokens against one of a token: a prompt chunk through the draft
        from kvserve.spec_decode.controller import ROW_GRID, StepCostModel
        grid = [n for n in ROW_GRID if n <= max(1, max_requests)] or [1]
        passes, catch_ups = worker.time_draft_model(grid, list(ROW_GRID))
        self.pass_model = StepCostModel(passes or {1: 0.0})
        self.prefill_model = StepCostModel(catch_ups or {1: 0.0})

    @classmethod
    def from_config(cls, config, worker) -> DraftModelProposer:
        return cls(worker, worker.load_draft_model(config.speculative.model),
                   config.scheduler.max_num_seqs)

    def pass_cost(self, num_requests: int) -> float:
        return self.pass_model(num_requests)

    def catch_up_cost(self, request: Request) -> float:
        pending = request.num_tokens - self._held.get(request.request_id, 0)
        if pending <= 1:
            return 0.0
        return max(0.0, self.prefill_model(pending) - self.prefill_model(1))

    def propose(self, requests: list[Request], limits: dict[str, int]) -> dict[str, list[int]]:
        asks = []
        for req in requests:
            k = min(limits.get(req.request_id, 0), self.max_positions - req.num_tokens)
            if k <= 0:
                continue
            # the last token gives the first draft's logits
            start = min(self._held.get(req.request_id, 0), req.num_tokens - 1)
            asks.append(DraftAsk(req.request_id, start,
                                 req.token_slice(start, req.num_tokens), k))
        if not asks:
            return {}
        proposal = self.worker.propose_drafts(asks)
        self._held = proposal.held
        return proposal.drafts

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)
        self.worker.forget_drafts(request_ids)
