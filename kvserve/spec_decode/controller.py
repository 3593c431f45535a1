"""How many drafts each request carries this step, chosen so that speculation pays.

Verifying k drafts costs k more rows in the step; it yields on average
α + α² + ... + α^k more tokens for a request whose drafts are accepted at rate α. The
step's cost by row count is measured at start (:class:`StepCostModel`); each step the
controller hands out draft slots one at a time to the request whose next draft is most
likely accepted, for as long as expected tokens per second of the step rise. Under
load a row costs as much as it can yield and no request gets drafts; a request whose
drafts keep failing stops getting them. Acceptance is estimated per request from its own
recent drafts (older ones count less each step, so a request that stopped getting
drafts is tried again later: its text may have started to repeat), starting from the
proposer's acceptance over all requests (from an even prior). When no request has
drafted for a while, the likeliest one gets one draft anyway: without it a proposer
whose first drafts look too dear under the prior would never show what it can do.

Proposing costs time too: per request asked (prompt lookup), or per draft position, one
pass of the draft model over the requests that reach it (a draft model). A pass costs
about as much for one request as for several, so the first drafts at a new position are
handed out as a group: the likeliest requests waiting there, as many as give the most
tokens per second. A proposer's one-time cost for a request (a draft model passing its
prompt) is spread over CATCH_UP_HORIZON steps.
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


class SpecDecodeController:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, cost: StepCostModel,
                 max_num_batched_tokens: int) -> None:
        self.k_max = config.num_speculative_tokens
        self.proposer, self.cost = proposer, cost
        self.budget = max_num_batched_tokens
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

    def draft_limits(self, running: list[Request]) -> dict[str, int]:
        """Drafts each decoding request may carry this step (absent: none)."""
        self._step += 1
        decodes = [r for r in running if r.num_computed_tokens + 1 == r.num_tokens]
        rows = min(self.budget, sum(r.num_tokens - r.num_computed_tokens for r in running))
        gain, seconds = float(len(decodes)), self.cost(rows)
        heap = []
        self._catch_up = {}
        prior = self.acceptance(None)
        for r in decodes:
            room = min(self.k_max, r.max_tokens - r.num_output_tokens - 1)
            if room > 0:
                alpha = self.acceptance(r.request_id, prior)
                heap.append((-alpha, r.request_id, 1, alpha, room))
                self._catch_up[r.request_id] = (self.proposer.catch_up_cost(r) / min(
                    r.max_tokens - r.num_output_tokens, CATCH_UP_HORIZON))
        heapq.heapify(heap)
        likeliest = heap[0][1] if heap else None
        limits: dict[str, int] = {}
        overhead = 0.0  # proposing's cost so far
        at_depth = [0] * (self.k_max + 1)  # requests handed a j-th draft so far
        while heap and rows < self.budget:
            if self.per_pass and at_depth[heap[0][2]] == 0 and self.proposer.pass_cost(1):
                opened = self._open_pass(heap, rows, gain, seconds, overhead)
                if opened is None:  # no group of requests pays for the pass
                    break
                group, rows, gain, seconds, overhead = opened
            else:
                neg_value, rid, j, alpha, room = heapq.heappop(heap)
                extra = (overhead + self._proposing_cost(j, at_depth[j])
                         + (self._catch_up[rid] if j == 1 else 0.0))
                more = self.cost(rows + 1) + extra
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
                and self._step - self._last_drafted >= EXPLORE_STEPS):
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
            rate = (gain + value) / (self.cost(rows + m) + overhead
                                     + self.proposer.pass_cost(m) + once)
            if rate > best_rate:
                best, best_rate, best_once = m, rate, once
        if not best:
            return None
        group = waiting[:best]
        heap[:] = [e for e in heap if e not in group]
        heapq.heapify(heap)
        added = -sum(e[0] for e in group)
        return (group, rows + best, gain + added, self.cost(rows + best),
                overhead + self.proposer.pass_cost(best) + best_once)

    def _proposing_cost(self, j: int, others: int) -> float:
        """What a request's j-th draft adds to proposing when ``others`` requests already
        have a j-th: a share of pass j's (a draft model), or the request's own cost at its
        first draft (prompt lookup)."""
        if not self.per_pass:
            return self.propose_seconds if j == 1 else 0.0
        cost = self.proposer.pass_cost
        if cost(1) is None:
            return self.propose_seconds if others == 0 else 0.0
        return cost(others + 1) - (cost(others) if others else 0.0)

    def propose(self, running: list[Request]) -> None:
        """Set each running request's draft tokens for the next step."""
        limits = self.draft_limits(running)
        drafts = {}
        if limits:
            start = time.perf_counter()
            drafts = self.proposer.propose(running, limits)
            units = max(limits.values()) if self.per_pass else len(limits)
            per_unit = (time.perf_counter() - start) / units
            self.propose_seconds += 0.1 * (per_unit - self.propose_seconds)
        for r in running:
            r.draft_token_ids = drafts.get(r.request_id, [])

    def record(self, output: SchedulerOutput, results: dict[str, list]) -> None:
        """Count what the step accepted (results: each request's new tokens)."""
        for sr in output.scheduled:
            if not sr.num_draft_tokens or sr.request_id not in results:
                continue
            accepted = len(results[sr.request_id]) - 1
            for rid in (sr.request_id, None):
                old_accepted, old_proposed = self._decayed(rid)
                record = (old_accepted + accepted, old_proposed + sr.num_draft_tokens,
                          self._step)
                if rid is None:
                    self._overall = record
                else:
                    self._history[rid] = record
            s = self.stats
            s.num_drafts += 1
            s.num_draft_tokens += sr.num_draft_tokens
            s.num_accepted_tokens += accepted
            for j in range(accepted):
                s.accepted_per_position[j] += 1
        if output.finished_ids:
            self.forget(output.finished_ids)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)
        self.proposer.forget(request_ids)


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
                                StepCostModel(times), sched.max_num_batched_tokens)
