"""StructuredOutputManager: the grammar state of every constrained sequence.

Each constrained sequence has a matcher that has consumed exactly its output tokens.
Before a step, drafts are cut at the first token the grammar refuses, and each
constrained row gets the mask of tokens allowed there (a drafted request's rows: the
mask after each draft prefix, then the matcher rolls back); the sampler and the draft
verifier apply the masks in their shared logits pass. After the step the matcher
consumes the tokens the request kept. A preempted request keeps its output, so its
matcher stays valid.

A request whose constraint follows a reasoning model's thinking has a gate
(:class:`~kvserve.structured_output.reasoning.ReasoningGate`): while it thinks, its rows
get no mask and its drafts stop before the token that would end the thinking; the
matcher consumes only what comes after.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvserve.structured_output.guidance import GuidanceBackend
from kvserve.structured_output.reasoning import ANSWERING, UNDECIDED, ReasoningGate

if TYPE_CHECKING:  # the engine's types the manager is handed; it imports no engine code
    from kvserve.core.scheduler_output import SchedulerOutput
    from kvserve.request import Request


class StructuredOutputManager:
    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: list[int]) -> None:
        self._args = (str(model_dir / "tokenizer.json"), vocab_size, eos_ids)
        self._backend: GuidanceBackend | None = None  # built on the first grammar
        self._matchers: dict[str, object] = {}
        self._gates: dict[str, ReasoningGate] = {}  # requests that may still be thinking
        self._opening_tokens: dict[str, torch.Tensor] = {}  # start tag -> tokens opening it
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
        span = req.sampling_params.structured_outputs.reasoning
        if span is not None:
            self._gates[req.request_id] = ReasoningGate(span)

    def remove(self, request_ids) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._gates.pop(rid, None)

    def _decode(self, token_ids: list[int]) -> str:
        return self.backend.tokenizer.decode_str(token_ids)

    def _gate(self, rid: str) -> ReasoningGate | None:
        """The request's gate while it has not reached its answer."""
        gate = self._gates.get(rid)
        return gate if gate is not None and gate.state != ANSWERING else None

    def _opening(self, start: str) -> torch.Tensor:
        """The tokens whose text opens ``start`` (a first token that starts thinking)."""
        if start not in self._opening_tokens:
            mask = torch.zeros(self.backend.vocab_size, dtype=torch.bool)
            for t in range(self.backend.vocab_size):
                if self._decode([t]).lstrip().startswith(start):
                    mask[t] = True
            self._opening_tokens[start] = mask
        return self._opening_tokens[start]

    def has_any(self) -> bool:
        return bool(self._matchers)

    def cut_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """The drafts (request id -> tokens), each constrained request's only up to the
        first one its grammar refuses."""
        cut = {}
        for rid, tokens in drafts.items():
            m = self._matchers.get(rid)
            gate = self._gate(rid)
            if gate is not None:
                tokens = gate.thinking_drafts(tokens, self._decode)
            elif m is not None:
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
        opening = []
        for s in out.scheduled:
            m = self._matchers.get(s.request_id)
            gate = self._gate(s.request_id)
            if m is None or not s.sample or (gate is not None and gate.state != UNDECIDED):
                continue  # unconstrained, or thinking: no mask
            if gate is not None:
                opening.append((s, m, gate))
            else:
                (drafted if s.num_draft_tokens else plain).append((s, m))
        masks = {}
        for s, m, gate in opening:  # the first token: the grammar's, or the start tag
            masks[s.request_id] = (self.backend.mask(m)
                                   | self._opening(gate.span.start)).unsqueeze(0)
        if plain:
            rows = self.backend.masks([m for _, m in plain])
            masks.update({s.request_id: rows[i:i + 1] for i, (s, _) in enumerate(plain)})
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
                tokens = req.output_token_ids[-kept:]
                gate = self._gate(req.request_id)
                if gate is not None:
                    tokens = gate.advance(tokens, self._decode)
                if tokens and not m.consume_tokens(tokens) and not m.is_stopped():
                    raise RuntimeError(f"request {req.request_id}: a sampled token broke "
                                       f"its grammar ({m.get_error()})")
