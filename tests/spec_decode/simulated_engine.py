"""The engine's step loop on a fake clock, for the controller's decisions.

Requests know their greedy continuation; a step's seconds are a function of its rows;
proposers charge their time to the same clock. The controller runs as in the engine
(``propose`` before the step, ``record`` after it), so what it decides can be scored in
tokens per simulated second, the same on every machine and however busy it is."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from kvserve.config.speculative import SpeculativeConfig
from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.controller import SpecDecodeController, StepCostModel
from kvserve.spec_decode.proposer import Proposer

VOCAB = 1000


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def random_tokens(n: int, seed: int) -> list[int]:
    """Ids in 0..VOCAB-2 (so that id + 1 is another valid id)."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB - 1) for _ in range(n)]


@dataclass
class SimRun:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: list[bool] = field(default_factory=list)  # per step: it carried drafts

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def drafted_share(self, after: int = 0) -> float:
        later = self.drafted[after:]
        return sum(later) / len(later)


class SimulatedEngine:
    """Requests run ``max_running`` at a time; a request's prompt is one step, then one
    decode per step, with the drafts the controller proposed (the accepted ones are the
    drafts that match the continuation, as greedy verification accepts them)."""

    def __init__(self, clock: FakeClock, step_seconds: Callable[[int], float],
                 controller: SpecDecodeController | None = None, max_running: int = 1):
        self.clock, self.step_seconds, self.controller = clock, step_seconds, controller
        self.max_running = max_running
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.continuations: dict[str, list[int]] = {}

    def add(self, request_id: str, prompt: list[int], continuation: list[int]) -> None:
        n = len(continuation)
        self.waiting.append(Request(request_id, list(prompt), SamplingParams(max_tokens=n),
                                    None, max_tokens=n))
        self.continuations[request_id] = list(continuation)

    def run(self) -> SimRun:
        run = SimRun()
        start = self.clock()
        while self.waiting or self.running:
            while self.waiting and len(self.running) < self.max_running:
                self.running.append(self.waiting.pop(0))
            drafted = self.step(run)
            run.drafted.append(drafted)
            run.steps += 1
        run.seconds = self.clock() - start
        return run

    def step(self, run: SimRun) -> bool:
        proposed = self.controller.propose(self.running) if self.controller else {}
        scheduled = []
        for req in self.running:
            if req.num_computed_tokens == 0:
                scheduled.append(ScheduledRequest(req.request_id, list(req.prompt_token_ids),
                                                  0, [], None))
                continue
            room = req.max_tokens - req.num_output_tokens - 1
            drafts = proposed.get(req.request_id, [])[:max(0, room)]
            scheduled.append(ScheduledRequest(req.request_id, [req.output_token_ids[-1]]
                                              + drafts, req.num_computed_tokens, [], None,
                                              len(drafts)))
        rows = sum(len(s.token_ids) for s in scheduled)
        self.clock.advance(self.step_seconds(rows))
        results, finished = {}, []
        for req, sr in zip(self.running, scheduled):
            truth = self.continuations[req.request_id]
            done = req.num_output_tokens
            drafts = sr.token_ids[1:] if sr.num_draft_tokens else []
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == truth[done + accepted]:
                accepted += 1
            results[req.request_id] = truth[done:done + accepted + 1]
        output = SchedulerOutput(scheduled)
        if self.controller is not None:
            self.controller.record(output, results)
        for req in self.running:
            req.output_token_ids.extend(results[req.request_id])
            req.num_computed_tokens = req.num_tokens - 1
            run.tokens += len(results[req.request_id])
            if req.num_output_tokens >= req.max_tokens:
                finished.append(req.request_id)
        self.running = [r for r in self.running if r.request_id not in finished]
        if self.controller is not None and finished:
            self.controller.forget(finished)
        return any(s.num_draft_tokens for s in scheduled)


class ChargedProposer(Proposer):
    """A proposer whose every call costs ``seconds_per_request`` of the fake clock per
    request asked (prompt lookup's own time, as if measured)."""

    def __init__(self, inner: Proposer, clock: FakeClock, seconds_per_request: float):
        self.inner, self.clock, self.seconds_per_request = inner, clock, seconds_per_request

    def propose(self, requests, limits):
        self.clock.advance(self.seconds_per_request * len(limits))
        return self.inner.propose(requests, limits)

    def forget(self, request_ids):
        self.inner.forget(request_ids)


class GuessingProposer(Proposer):
    """Drafts from the true continuation, each one right with probability ``right``
    (seeded by request and position: the same on every run), else off by one."""

    def __init__(self, engine: SimulatedEngine, right: float, clock: FakeClock,
                 seconds_per_request: float = 0.0):
        self.engine, self.right, self.clock = engine, right, clock
        self.seconds_per_request = seconds_per_request

    def guess(self, req: Request, k: int) -> list[int]:
        truth = self.engine.continuations[req.request_id]
        done = req.num_output_tokens
        out = []
        for pos in range(done, min(done + k, len(truth))):
            lucky = random.Random(f"{req.request_id}:{pos}").random() < self.right
            out.append(truth[pos] if lucky else (truth[pos] + 1) % VOCAB)
        return out

    def propose(self, requests, limits):
        self.clock.advance(self.seconds_per_request * len(limits))
        return {r.request_id: self.guess(r, limits[r.request_id]) for r in requests
                if limits.get(r.request_id)}


class FakeDraftModel(GuessingProposer):
    """A draft model: each draft position is one pass, which costs ``real_pass_s`` on the
    fake clock, whatever start-up measured (``startup_pass_s``)."""

    cost_unit = "pass"

    def __init__(self, engine, right, clock, startup_pass_s: float, real_pass_s: float):
        super().__init__(engine, right, clock)
        self.startup_pass_s, self.real_pass_s = startup_pass_s, real_pass_s

    def pass_cost(self, num_requests: int) -> float:
        return self.startup_pass_s

    def propose(self, requests, limits):
        self.clock.advance(self.real_pass_s * max(limits.values()))
        return super().propose(requests, limits)


def controller(proposer: Proposer, clock: FakeClock, startup_seconds_by_rows: dict,
               k: int = 4, learn: bool = True) -> SpecDecodeController:
    return SpecDecodeController(SpeculativeConfig(method="ngram", num_speculative_tokens=k),
                                proposer, StepCostModel(startup_seconds_by_rows), 2048,
                                clock=clock, learn_from_steps=learn)
