"""Whether drafting pays, as measured while the engine runs, not only as predicted.

The rule: draft only while the tokens that steps with drafting give, per token the same
steps would give without it (the yield), are at least what drafting costs, per second
those steps would take without it (the cost). Each step is timed from proposing to its
tokens. Steps that carry no drafts measure the baseline, a plain step's seconds by row
count (:class:`StepBaseline`). Over the last EVIDENCE_STEPS steps the planner decided:

- yield: their tokens over their tokens less the drafts accepted;
- cost: the median slowdown of their model step against the baseline's seconds for
  their rows less the drafts (at least 1: verifying drafts never makes a step faster),
  plus their planning and proposing time over those baseline seconds.

When the yield falls below the cost (once TRIAL_STEPS steps are in, or two that each
lose more than CLEAR_LOSS lets pass), CONFIRM_STEPS plain steps refresh the baseline and
the steps are priced again; if they still lose, drafting stops (:class:`DraftingGate`).
It is tried again after enough plain steps that trials which do not pay cost at most
TRIAL_BUDGET of the time: what the last one lost, in plain steps (as the quieter of its
steps show it), over TRIAL_BUDGET, TRIAL_GAP_MIN to TRIAL_GAP_MAX steps. While every
step drafts, one in PROBE_EVERY (PROBE_EVERY_NEAR while yield and cost are within
NEAR_EVEN of each other) is left plain so that the baseline follows the machine's load.

Medians, and a step's proposing counted at most STALL times the median, because on a
busy machine a step now and then stalls (another process, a collection): one stalled
step must neither stop drafting that pays nor keep drafting that does not. A cost that
comes once in many steps (a draft model catching up on a prompt) is thus the planner's
to weigh (it is told what the proposer's calls really take), not the gate's.
"""
from __future__ import annotations

import collections
import enum
import statistics
from dataclasses import dataclass

TRIAL_STEPS = 3      # planned steps before their yield and cost may stop drafting ...
CLEAR_LOSS = 0.75    # ... or two, when each one's yield is below this share of its cost
EVIDENCE_STEPS = 9   # the recent planned steps whose yield and cost are compared
STALL = 3.0          # a step's proposing counts at most this times the recent median
TRIAL_BUDGET = 0.01  # the share of time that trials of drafting which do not pay may cost
TRIAL_GAP_MIN = 48   # plain steps before drafting that stopped is tried again, at least ...
TRIAL_GAP_MAX = 512  # ... and at most
PROBE_EVERY = 32     # drafted steps in a row before one is left plain (the baseline) ...
PROBE_EVERY_NEAR = 8  # ... while yield over cost is under NEAR_EVEN: a stale baseline
NEAR_EVEN = 1.5       # (the machine's load changed) would more easily flip the decision
BASELINE_STEPS = 3   # the recent plain steps of a row band whose median is its baseline
BASELINE_MIN = 3     # plain steps of a row band measured before drafting at about its rows
CONFIRM_STEPS = 2    # plain steps measured before a loss stops drafting (fresh baseline)


class RecentMedian:
    """The median of the last ``size`` samples (``initial`` before any): a scale that
    one outlier does not move and a few consistent samples do. Computed when read."""

    def __init__(self, size: int = 7, initial: float = 1.0) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=size)
        self._median: float | None = initial

    def add(self, sample: float) -> None:
        self._samples.append(sample)
        self._median = None

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self._samples)
        return self._median

    def __len__(self) -> int:
        return len(self._samples)


class StepBaseline:
    """Seconds of a step without drafts, by row count: the start-up measurement
    (``startup``, a StepCostModel) times a ratio learned from real plain steps, the
    median of the last BASELINE_STEPS in each power-of-two band of row counts (1, 2-3,
    4-7, ...). A band not yet measured BASELINE_MIN times takes its nearest such
    neighbour's ratio."""

    def __init__(self, startup) -> None:
        self.startup = startup
        self._ratio: dict[int, RecentMedian] = {}  # band -> measured / start-up seconds

    @staticmethod
    def band(rows: int) -> int:
        return max(1, rows).bit_length()

    def observe(self, rows: int, seconds: float) -> None:
        predicted = self.startup(rows) if rows > 0 else 0.0
        if seconds <= 0 or predicted <= 0:
            return
        self._ratio.setdefault(self.band(rows), RecentMedian(BASELINE_STEPS)).add(
            seconds / predicted)

    def _measured_bands(self) -> list[int]:
        """Bands with BASELINE_MIN plain steps or more, else any measured."""
        return ([b for b, m in self._ratio.items() if len(m) >= BASELINE_MIN]
                or list(self._ratio))

    def knows(self, rows: int) -> bool:
        """Whether BASELINE_MIN plain steps of about this many rows (this band or a
        neighbour) were measured."""
        band = self.band(rows)
        return any(b in self._ratio and len(self._ratio[b]) >= BASELINE_MIN
                   for b in (band - 1, band, band + 1))

    def ratio(self, rows: int) -> float:
        """Measured over start-up seconds near ``rows``; 1.0 before any plain step."""
        if not self._ratio:
            return 1.0
        band = self.band(rows)
        nearest = min(self._measured_bands(), key=lambda b: (abs(b - band), b))
        return self._ratio[nearest].value

    def seconds(self, rows: int) -> float:
        return self.startup(rows) * self.ratio(rows)


@dataclass(frozen=True)
class MeasuredStep:
    """One step as it ran: what the controller hands the gate after the step."""

    planned: bool          # the planner decided this step's drafts (it had decodes to weigh)
    rows: int              # rows the step computed, drafts included
    draft_rows: int        # of them, drafts verified
    tokens: int            # tokens the step gave
    accepted: int          # of them, accepted drafts
    seconds: float         # from proposing to the step's tokens
    proposing_seconds: float  # of them, planning and proposing


class StepMode(enum.Enum):
    PLAN = "plan"    # the planner decides the drafts
    TRIAL = "trial"  # the planner decides, and if it gives none the likeliest gets one
    PLAIN = "plain"  # no drafts: drafting stopped, or a probe of the baseline


@dataclass
class _PlannedStep:
    """What the gate keeps of a planned step, so that it can be priced again against a
    newer baseline."""

    tokens: int
    plain_tokens: int             # its tokens less the accepted drafts
    model_seconds: float | None   # seconds outside planning and proposing (None: no drafts)
    proposing_seconds: float
    plain_rows: int               # its rows less the drafts
    plain_seconds: float = 0.0    # the baseline's for plain_rows, when last priced
    slowdown: float = 1.0         # model_seconds over plain_seconds

    def price(self, baseline: StepBaseline) -> None:
        self.plain_seconds = baseline.seconds(self.plain_rows)
        if self.model_seconds is not None and self.plain_seconds > 0:
            # verifying drafts never makes a step faster: less is noise, or a baseline
            # measured while the machine was busier
            self.slowdown = max(1.0, self.model_seconds / self.plain_seconds)

    @property
    def ratio(self) -> float:
        """This step's yield over its cost."""
        return ((self.tokens / self.plain_tokens)
                / (self.slowdown + self.proposing_seconds / self.plain_seconds))


class DraftingGate:
    """Opens and closes drafting on the measured ratio (see the module's rule)."""

    def __init__(self, baseline: StepBaseline) -> None:
        self.baseline = baseline
        self.open = True          # the first planned steps are a trial too
        self.trial_gap = TRIAL_GAP_MIN  # the wait after the last trial that did not pay
        self._wait = 0            # plain steps left before the next trial (closed)
        self._confirming = 0      # plain steps left before a loss is confirmed (open)
        self._drafted_in_a_row = 0
        self._reset_evidence()

    def _reset_evidence(self) -> None:
        # the planned steps since opening, the last EVIDENCE_STEPS of them
        self._evidence: collections.deque[_PlannedStep] = collections.deque(
            maxlen=EVIDENCE_STEPS)

    def _yield_and_cost(self) -> tuple[float, float]:
        """The rule's yield and cost of the recent planned steps, per plain step."""
        steps = self._evidence
        tokens = sum(e.tokens for e in steps)
        plain_tokens = sum(e.plain_tokens for e in steps)
        plain_seconds = sum(e.plain_seconds for e in steps)
        slowdown = statistics.median(e.slowdown for e in steps)
        stalled = STALL * statistics.median(e.proposing_seconds for e in steps)
        proposing = sum(min(e.proposing_seconds, stalled) for e in steps)
        return tokens / plain_tokens, slowdown + proposing / plain_seconds

    @property
    def measured_ratio(self) -> float | None:
        """Yield over cost of the recent planned steps (None: none yet): below 1,
        drafting loses throughput."""
        if not self._evidence:
            return None
        gain, cost = self._yield_and_cost()
        return gain / cost

    def _losing(self) -> bool:
        if len(self._evidence) >= TRIAL_STEPS:
            return self.measured_ratio < 1.0
        # too few steps for a median: a clear loss only if every one shows it
        return len(self._evidence) >= 2 and all(e.ratio < CLEAR_LOSS for e in self._evidence)

    def mode(self, rows_of) -> StepMode:
        """How this step's drafts are chosen (``rows_of()``: the step's rows before
        drafts, asked only when drafting is on)."""
        if not self.open:
            self._wait -= 1
            if self._wait > 0:
                return StepMode.PLAIN
            self.open = True
            self._reset_evidence()
        if self._confirming:
            return StepMode.PLAIN  # a fresh baseline before a loss stops drafting
        rows = rows_of()
        if rows > 0 and (not self.baseline.knows(rows)
                         or self._drafted_in_a_row >= self._probe_every()):
            return StepMode.PLAIN  # a probe: the baseline for steps like this one
        return StepMode.TRIAL if len(self._evidence) < TRIAL_STEPS else StepMode.PLAN

    def _probe_every(self) -> int:
        ratio = self.measured_ratio
        return PROBE_EVERY if ratio is not None and ratio >= NEAR_EVEN else PROBE_EVERY_NEAR

    def observe(self, step: MeasuredStep) -> None:
        model_seconds = step.seconds - step.proposing_seconds
        if step.draft_rows == 0:
            self.baseline.observe(step.rows, model_seconds)
            self._drafted_in_a_row = 0
        else:
            self._drafted_in_a_row += 1
        if self._confirming and not step.planned:
            self._confirming -= 1
            if not self._confirming:  # priced again against the baseline just measured
                for entry in self._evidence:
                    entry.price(self.baseline)
                if self._losing():
                    self._close()
            return
        if not (self.open and step.planned) or step.tokens <= step.accepted:
            return
        entry = _PlannedStep(step.tokens, step.tokens - step.accepted,
                             model_seconds if step.draft_rows else None,
                             step.proposing_seconds, step.rows - step.draft_rows)
        entry.price(self.baseline)
        if entry.plain_seconds <= 0:
            return
        self._evidence.append(entry)
        if self._losing():
            self._confirming = CONFIRM_STEPS

    def _close(self) -> None:
        gain, _ = self._yield_and_cost()
        # what the trial lost, in plain steps' worth of time, as the quieter of its steps
        # show it (their lower quartile, and a typical step's proposing): steps that
        # stalled, however many, must not put off the next trial for long
        slowdowns = sorted(e.slowdown for e in self._evidence)
        typical = (slowdowns[len(slowdowns) // 4]
                   + statistics.median(e.proposing_seconds / e.plain_seconds
                                       for e in self._evidence))
        lost = len(self._evidence) * (typical - gain)
        self.trial_gap = round(min(max(lost / TRIAL_BUDGET, TRIAL_GAP_MIN), TRIAL_GAP_MAX))
        self.open, self._wait = False, self.trial_gap
        self._reset_evidence()
