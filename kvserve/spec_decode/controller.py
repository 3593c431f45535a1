"""How many drafts each request carries this step, chosen so that speculation pays.

The rule: draft only while it measurably pays. Every step is timed as it runs; steps
without drafts measure what a step costs plain, and the steps the controller plans are
set against themselves undrafted: when their tokens per token undrafted fall below their
seconds per second undrafted, drafting stops, and is tried again now and then
(:mod:`kvserve.spec_decode.measured_yield`, which states it in full).

Within that, a planner decides each step's drafts. Verifying k drafts costs k more rows
in the step; it yields on average α + α² + ... + α^k more tokens for a request whose
drafts are accepted at rate α. The step's cost by row count is measured at start
(:class:`StepCostModel`) and scaled to what plain steps really take; each step the
controller hands out draft slots one at a time to the request whose next draft is most
likely accepted, for as long as expected tokens per second of the step rise. Under
load a row costs as much as it can yield and no request gets drafts; a request whose
drafts keep failing (or that is asked and gets none) stops getting them. Acceptance is
estimated per request from its own recent drafts (older ones count less each step, so a
request that stopped getting drafts is tried again later: its text may have started to
repeat), starting from the proposer's acceptance over all requests (from an even prior).
When no request has drafted for a while, the likeliest one gets one draft anyway:
without it a proposer whose first drafts look too dear under the prior would never show
what it can do.

Proposing costs time too: per request asked (prompt lookup, timed as it runs), or per
draft position, one pass of the draft model over the requests that reach it (a draft
model: measured at start, scaled to what its real passes take). A pass costs about as
much for one request as for several, so the first drafts at a new position are handed
out as a group: the likeliest requests waiting there, as many as give the most tokens
per second. A proposer's one-time cost for a request (a draft model passing its prompt)
is spread over CATCH_UP_HORIZON steps.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from dataclasses import dataclass, field

from kvserve.config.speculative import SpeculativeConfig
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.request import Request
from kvserve.spec_decode.measured_yield import (DraftingGate, MeasuredStep, RecentMedian,
                                                StepBaseline, StepMode)
from kvserve.spec_decode.proposer import Proposer


class StepCostModel:
    """Seconds of a step by the rows it computes, linear between measured points (called
    many times a step: plain floats and a bisection, no numpy)."""

    def __init__(self, seconds_by_rows: dict[int, float]) -> None:
        if not seconds_by_rows:
            raise ValueError("a step cost model needs at least one measured row count")
        rows = sorted(seconds_by_rows)
        self.rows = [float(r) for r in rows]
        # a step never gets cheaper with more rows: smooth out measurement noise
        self.seconds = [float(t) for t in itertools.accumulate(
            (seconds_by_rows[r] for r in rows), max)]

    def __call__(self, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if rows >= xs[-1]:
            if len(xs) == 1:
                return ys[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])  # extrapolate the last slope
            return ys[-1] + slope * (rows - xs[-1])
        i = bisect.bisect_right(xs, rows)
        if i == 0:
            return ys[0]
        x0, x1, y0 = xs[i - 1], xs[i], ys[i - 1]
        return y0 + (ys[i] - y0) * (rows - x0) / (x1 - x0)


@dataclass
class SpecDecodeStats:
    """Cumulative counts with vLLM's meanings (spec_decode_num_* metrics)."""

    num_drafts: int = 0           # request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


PRIOR_ACCEPTANCE = 0.5  # the proposer's estimate before any draft ...
PRIOR_WEIGHT = 2.0      # ... worth this many draft tokens (a request's prior: the proposer's)
DECAY = 0.95            # per step, the weight of a request's older drafts
EXPLORE_STEPS = 32      # steps without any draft before one is tried anyway
# steps a one-time cost of drafting (a draft model's catch-up) is spread over: how long a
# decision to draft is trusted to last (under a growing load it does not last long)
CATCH_UP_HORIZON = 16


@dataclass
class _ProposedStep:
    """What ``propose`` leaves for ``record`` of the same step."""

    start: float                 # the clock as proposing began
    proposing_seconds: float     # planning and proposing
    planned: bool
    asked: frozenset[str]        # requests the proposer was asked for drafts


class SpecDecodeController:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, cost: StepCostModel,
                 max_num_batched_tokens: int, clock=time.perf_counter,
                 learn_from_steps: bool = True) -> None:
        """``cost``: the start-up step cost; ``clock``: seconds, read around each step;
        ``learn_from_steps`` False: trust the start-up costs alone (no gate, no scaling)."""
        self.k_max = config.num_speculative_tokens
        self.proposer, self.cost = proposer, cost
        self.budget = max_num_batched_tokens
        self.clock = clock
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k_max)
        self._history: dict[str, tuple[float, float, int]] = {}  # accepted, proposed, step
        self._overall = (0.0, 0.0, 0)  # the same over every request's drafts
        self._step = 0
        self._last_drafted = 0  # the step that last handed out drafts
        # this step's requests: the proposer's one-time cost of their next drafts (a draft
        # model catching up on a prompt), spread over CATCH_UP_HORIZON steps
        self._catch_up: dict[str, float] = {}
        self.per_pass = proposer.cost_unit == "pass"
        self.propose_seconds = 0.0  # per request (or pass) of proposing, a moving average
        self.gate = DraftingGate(StepBaseline(cost)) if learn_from_steps else None
        # a draft model's real passes (and catch-ups) over their start-up measurement
        self._pass_scale = RecentMedian()
        self._step_scale = 1.0  # this step's: real plain steps over the start-up measurement
        self._pass_unit = 1.0   # this step's pass_scale
        self._had_candidates = False  # the last planning had decodes to weigh
        self._proposed: _ProposedStep | None = None

    # -- costs as measured ---------------------------------------------------------------

    @property
    def pass_scale(self) -> float:
        return self._pass_scale.value

    def _step_seconds(self, rows: int) -> float:
        return self._step_scale * self.cost(rows)

    def _pass_seconds(self, num_requests: int) -> float | None:
        seconds = self.proposer.pass_cost(num_requests)
        return None if seconds is None else self._pass_unit * seconds

    def _decayed(self, request_id: str | None) -> tuple[float, float]:
        """(accepted, proposed) of a request (None: of all), older drafts weighing less."""
        record = self._overall if request_id is None else self._history.get(request_id)
        accepted, proposed, step = record or (0.0, 0.0, self._step)
        weight = DECAY ** (self._step - step)
        return accepted * weight, proposed * weight

    def acceptance(self, request_id: str | None, prior: float | None = None) -> float:
        """Estimated chance that a draft of this request (None: any) is accepted;
        ``prior``: the estimate for any request, when already computed."""
        if request_id is None:
            prior = PRIOR_ACCEPTANCE
        elif prior is None:
            prior = self.acceptance(None)
        accepted, proposed = self._decayed(request_id)
        return (accepted + PRIOR_WEIGHT * prior) / (proposed + PRIOR_WEIGHT)

    # -- planning ------------------------------------------------------------------------

    def _rows(self, running: list[Request]) -> int:
        """Rows of the coming step before drafts, as far as the running requests tell."""
        return min(self.budget, sum(r.num_tokens - r.num_computed_tokens for r in running))

    def draft_limits(self, running: list[Request], trial: bool = False) -> dict[str, int]:
        """Drafts each decoding request may carry this step (absent: none); ``trial``:
        if none pays, the likeliest request gets one anyway (drafting on trial)."""
        self._step += 1
        decodes = [r for r in running if r.num_computed_tokens + 1 == r.num_tokens]
        rows = self._rows(running)
        if self.gate is not None:
            self._step_scale, self._pass_unit = self.gate.baseline.ratio(rows), self.pass_scale
        gain, seconds = float(len(decodes)), self._step_seconds(rows)
        heap = []
        self._catch_up = {}
        prior = self.acceptance(None)
        for r in decodes:
            room = min(self.k_max, r.max_tokens - r.num_output_tokens - 1)
            if room > 0:
                alpha = self.acceptance(r.request_id, prior)
                heap.append((-alpha, r.request_id, 1, alpha, room))
                self._catch_up[r.request_id] = (
                    self._pass_unit * self.proposer.catch_up_cost(r)
                    / min(r.max_tokens - r.num_output_tokens, CATCH_UP_HORIZON))
        heapq.heapify(heap)
        self._had_candidates = bool(heap)
        likeliest = heap[0][1] if heap else None
        limits: dict[str, int] = {}
        overhead = 0.0  # proposing's cost so far
        at_depth = [0] * (self.k_max + 1)  # requests handed a j-th draft so far
        while heap and rows < self.budget:
            if self.per_pass and at_depth[heap[0][2]] == 0 and self._pass_seconds(1):
                opened = self._open_pass(heap, rows, gain, seconds, overhead)
                if opened is None:  # no group of requests pays for the pass
                    break
                group, rows, gain, seconds, overhead = opened
            else:
                neg_value, rid, j, alpha, room = heapq.heappop(heap)
                extra = (overhead + self._proposing_cost(j, at_depth[j])
                         + (self._catch_up[rid] if j == 1 else 0.0))
                more = self._step_seconds(rows + 1) + extra
                if (gain - neg_value) * (seconds + overhead) <= gain * more:  # tokens/s drop
                    break
                rows, gain, seconds, overhead = rows + 1, gain - neg_value, more - extra, extra
                group = [(neg_value, rid, j, alpha, room)]
            for neg_value, rid, j, alpha, room in group:
                limits[rid] = j
                at_depth[j] += 1
                if j < room:
                    heapq.heappush(heap, (neg_value * alpha, rid, j + 1, alpha, room))
        if (not limits and likeliest is not None
                and (trial or self._step - self._last_drafted >= EXPLORE_STEPS)):
            limits[likeliest] = 1
        if limits:
            self._last_drafted = self._step
        return limits

    def _open_pass(self, heap: list, rows: int, gain: float, seconds: float,
                   overhead: float):
        """The first drafts at the heap's next depth, taken together: a draft model's pass
        costs about the same for one request or several, so a draft that would not pay
        alone may pay in company. The likeliest m of the requests waiting at that depth,
        for the m that gives the most tokens per second, if that beats the step without
        them; they leave the heap. Returns (the group, rows, gain, seconds, overhead) or
        None."""
        depth = heap[0][2]
        waiting = sorted(e for e in heap if e[2] == depth)  # likeliest first
        best, best_rate = 0, gain / (seconds + overhead)
        value = once = 0.0
        for m in range(1, min(len(waiting), self.budget - rows) + 1):
            value -= waiting[m - 1][0]
            once += self._catch_up[waiting[m - 1][1]] if depth == 1 else 0.0
            rate = (gain + value) / (self._step_seconds(rows + m) + overhead
                                     + self._pass_seconds(m) + once)
            if rate > best_rate:
                best, best_rate, best_once = m, rate, once
        if not best:
            return None
        group = waiting[:best]
        heap[:] = [e for e in heap if e not in group]
        heapq.heapify(heap)
        added = -sum(e[0] for e in group)
        return (group, rows + best, gain + added, self._step_seconds(rows + best),
                overhead + self._pass_seconds(best) + best_once)

    def _proposing_cost(self, j: int, others: int) -> float:
        """What a request's j-th draft adds to proposing when ``others`` requests already
        have a j-th: a share of pass j's (a draft model), or the request's own cost at its
        first draft (prompt lookup)."""
        if not self.per_pass:
            return self.propose_seconds if j == 1 else 0.0
        cost = self._pass_seconds
        if cost(1) is None:
            return self.propose_seconds if others == 0 else 0.0
        return cost(others + 1) - (cost(others) if others else 0.0)

    # -- the step ------------------------------------------------------------------------

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Each running request's draft tokens for the next step (absent: none), for the
        scheduler to take (:meth:`~kvserve.core.scheduler.Scheduler.set_drafts`)."""
        start = self.clock()
        mode = (StepMode.PLAN if self.gate is None
                else self.gate.mode(lambda: self._rows(running)))
        if mode is StepMode.PLAIN:
            self._step += 1  # older drafts keep losing weight while none are made
            limits, self._had_candidates = {}, False
        else:
            limits = self.draft_limits(running, trial=mode is StepMode.TRIAL)
        drafts = {}
        if limits:
            predicted = self._predicted_passes(running, limits)
            begun = self.clock()
            drafts = self.proposer.propose(running, limits)
            spent = self.clock() - begun
            units = max(limits.values()) if self.per_pass else len(limits)
            self.propose_seconds += 0.1 * (spent / units - self.propose_seconds)
            if predicted and self.gate is not None:
                self._pass_scale.add(spent / predicted)
        drafts = {r.request_id: drafts[r.request_id] for r in running
                  if drafts.get(r.request_id)}
        self._proposed = _ProposedStep(start, self.clock() - start,
                                       mode is not StepMode.PLAIN and self._had_candidates,
                                       frozenset(limits))
        return drafts

    def _predicted_passes(self, running: list[Request], limits: dict[str, int]) -> float:
        """Start-up seconds of the passes and catch-ups these limits ask of a draft model
        (0.0: the proposer does not measure its passes)."""
        if not self.per_pass or self.proposer.pass_cost(1) is None:
            return 0.0
        depths = sorted(limits.values(), reverse=True)
        passes = sum(self.proposer.pass_cost(sum(1 for k in depths if k >= j))
                     for j in range(1, depths[0] + 1))
        return passes + sum(self.proposer.catch_up_cost(r) for r in running
                            if r.request_id in limits)

    def record(self, output: SchedulerOutput, results: dict[str, list]) -> None:
        """Count what the step accepted (results: each request's new tokens), and what
        it cost against the same step without drafts."""
        proposed, self._proposed = self._proposed, None
        asked = proposed.asked if proposed is not None else frozenset()
        accepted_in_step = 0
        for sr in output.scheduled:
            if sr.request_id not in results:
                continue
            if not sr.num_draft_tokens:
                if sr.request_id in asked:  # asked, and no draft came: a draft that failed
                    self._count_drafts(sr.request_id, 0, 1)
                continue
            accepted = len(results[sr.request_id]) - 1
            accepted_in_step += accepted
            self._count_drafts(sr.request_id, accepted, sr.num_draft_tokens)
            s = self.stats
            s.num_drafts += 1
            s.num_draft_tokens += sr.num_draft_tokens
            s.num_accepted_tokens += accepted
            for j in range(accepted):
                s.accepted_per_position[j] += 1
        if proposed is not None and self.gate is not None and output.scheduled:
            self.gate.observe(MeasuredStep(
                planned=proposed.planned, rows=output.num_tokens,
                draft_rows=sum(sr.num_draft_tokens for sr in output.scheduled),
                tokens=sum(len(results.get(sr.request_id, ())) for sr in output.scheduled),
                accepted=accepted_in_step, seconds=self.clock() - proposed.start,
                proposing_seconds=proposed.proposing_seconds))
        if output.finished_ids:
            self.forget(output.finished_ids)

    def _count_drafts(self, request_id: str, accepted: int, proposed: int) -> None:
        """Add a step's drafts to the request's and the overall decayed record."""
        for rid in (request_id, None):
            old_accepted, old_proposed = self._decayed(rid)
            record = (old_accepted + accepted, old_proposed + proposed, self._step)
            if rid is None:
                self._overall = record
            else:
                self._history[rid] = record

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)
        self.proposer.forget(request_ids)


# False: engines trust the start-up costs alone, without measuring steps as they run (for
# tests whose fake start-up costs must decide the drafts, whatever the machine's load)
LEARN_FROM_STEPS = True
# row counts whose step time is measured at start (a denser grid where steps are small)
ROW_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128, 160, 192, 256,
            384, 512)


def create_controller(config, worker) -> SpecDecodeController | None:
    """The controller for ``config.speculative`` (None: speculation off), with the step
    cost measured now on ``worker``."""
    from kvserve.logger import init_logger
    from kvserve.spec_decode import PROPOSERS

    spec = config.speculative
    if spec is None:
        return None
    sched = config.scheduler
    limit = min(sched.max_num_batched_tokens, sched.max_num_seqs * (spec.num_speculative_tokens
                                                                    + 1))
    grid = [r for r in ROW_GRID if r <= limit] or [1]
    times = worker.time_step_rows(grid)
    init_logger(__name__).info(
        "speculative decoding (%s, up to %d tokens): step ms by rows %s", spec.method,
        spec.num_speculative_tokens,
        " ".join(f"{r}:{1000 * t:.1f}" for r, t in times.items()))
    return SpecDecodeController(spec, PROPOSERS[spec.method].from_config(config, worker),
                                StepCostModel(times), sched.max_num_batched_tokens,
                                learn_from_steps=LEARN_FROM_STEPS)
