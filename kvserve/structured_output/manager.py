"""StructuredOutputManager: the grammar state of every constrained sequence.

Each constrained sequence has a matcher that has consumed exactly its output tokens.
Before a step, drafts are cut at the first token the grammar refuses, and each
constrained row gets the mask of tokens allowed there (a drafted request's rows: the
mask after each draft prefix, then the matcher rolls back); the sampler and the draft
verifier apply the masks in their shared logits pass. After the step the matcher
consumes the tokens the request kept. A preempted request keeps its output, so its
matcher stays valid.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvserve.structured_output.guidance import GuidanceBackend

if TYPE_CHECKING:  # the engine's types the manager is handed; it imports no engine code
    from kvserve.core.scheduler_output import SchedulerOutput
    from kvserve.request import Request


class StructuredOutputManager:
    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: list[int]) -> None:
        self._args = (str(model_dir / "tokenizer.json"), vocab_size, eos_ids)
        self._backend: GuidanceBackend | None = None  # built on the first grammar
        self._matchers: dict[str, object] = {}
        self.mask_seconds = 0.0  # cumulative time computing masks, and how many rows
        self.masked_rows = 0
        self._pool: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> GuidanceBackend:
        if self._backend is None:
            self._backend = GuidanceBackend(*self._args)
        return self._backend

    def compile(self, req_params) -> str:
        """Check and compile a request's grammar (ValueError: refuse the request)."""
        return self.backend.compile(*req_params.structured_outputs.spec())

    def add(self, req: Request, grammar: str) -> None:
        self._matchers[req.request_id] = self.backend.matcher(grammar)

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def has_any(self) -> bool:
        return bool(self._matchers)

    def cut_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts (request id -> tokens), each constrained request's only up to the
        first one its grammar refuses."""
        cut = {}
        for rid, tokens in drafts.items():
            m = self._matchers.get(rid)
            if m is not None:
                ok = m.try_consume_tokens(tokens)
                if ok:
                    m.rollback(ok)
                tokens = tokens[:ok]
            cut[rid] = tokens
        return cut

    def masks_in_background(self, out: SchedulerOutput) -> Future:
        """:meth:`masks` on a helper thread: the worker runs the model meanwhile and
        waits for them only when it samples (llguidance releases the GIL)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        return self._pool.submit(self.masks, out)

    def masks(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Allowed tokens [rows, vocab] for each constrained request that samples: one
        batched call for the requests without drafts, draft by draft for the others."""
        start = time.perf_counter()
        plain, drafted = [], []
        for s in out.scheduled:
            m = self._matchers.get(s.request_id)
            if m is not None and s.sample:
                (drafted if s.num_draft_tokens else plain).append((s, m))
        masks = {}
        if plain:
            rows = self.backend.masks([m for _, m in plain])
            masks = {s.request_id: rows[i:i + 1] for i, (s, _) in enumerate(plain)}
        for s, m in drafted:
            rows = [self.backend.mask(m)]
            for d in s.token_ids[len(s.token_ids) - s.num_draft_tokens:]:
                m.consume_token(d)
                rows.append(self.backend.mask(m))
            m.rollback(s.num_draft_tokens)
            masks[s.request_id] = torch.stack(rows)
        self.masked_rows += sum(len(r) for r in masks.values())
        self.mask_seconds += time.perf_counter() - start
        return masks

    def advance(self, progressed: list[tuple[Request, int]]) -> None:
        """Consume the tokens each constrained request kept this step."""
        for req, kept in progressed:
            m = self._matchers.get(req.request_id)
            if m is not None and kept:
                if not m.consume_tokens(req.output_token_ids[-kept:]) and not m.is_stopped():
                    raise RuntimeError(f"request {req.request_id}: a sampled token broke "
                                       f"its grammar ({m.get_error()})")
