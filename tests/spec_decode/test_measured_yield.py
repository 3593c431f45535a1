"""Never a slowdown, as measured: drafting stops where the steps show it does not pay.

The decisions are tested on a fake clock (:mod:`tests.spec_decode.simulated_engine`):
text and proposers the controller was never tuned on, start-up costs that are wrong,
and throughput compared with no speculation in simulated seconds, the same on every
machine. Each such case also runs with ``learn_from_steps=False`` (the start-up costs
trusted alone) to show it is one where that loses throughput."""
from __future__ import annotations

import pytest

from kvserve.spec_decode.controller import StepCostModel
from kvserve.spec_decode.measured_yield import (BASELINE_MIN, BASELINE_STEPS, CLEAR_LOSS,
                                                CONFIRM_STEPS, EVIDENCE_STEPS, PROBE_EVERY,
                                                STALL, TRIAL_BUDGET, TRIAL_GAP_MAX,
                                                TRIAL_GAP_MIN, TRIAL_STEPS, DraftingGate,
                                                MeasuredStep, StepBaseline, StepMode)
from kvserve.spec_decode.ngram import NgramProposer
from tests.spec_decode.simulated_engine import (ChargedProposer, FakeClock, FakeDraftModel,
                                                GuessingProposer, SimulatedEngine,
                                                controller, random_tokens)

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def real_step(rows: int) -> float:
    """What a step really takes in the simulation: 10 ms and 0.2 ms a row."""
    return 0.010 + 0.0002 * rows


TRUE_STARTUP = {r: real_step(r) for r in GRID}             # start-up measured it right
FLAT_STARTUP = {r: 1.0 * (1 + r / 1000) for r in GRID}     # says rows are free, steps dear


def random_workload(n: int, out: int = 200, seed: int = 0) -> list[tuple]:
    """Prompts and continuations of random ids: prompt lookup finds next to nothing."""
    return [(f"r{i}", random_tokens(300, seed + 2 * i), random_tokens(out, seed + 2 * i + 1))
            for i in range(n)]


def repetitive_workload(n: int, period: int = 37, out: int = 200) -> list[tuple]:
    """A random pattern repeated: prompt lookup predicts nearly every token."""
    workload = []
    for i in range(n):
        text = random_tokens(period, 100 + i) * (2 + out // period + 1)
        workload.append((f"r{i}", text[:2 * period], text[2 * period:2 * period + out]))
    return workload


def speedup(make_proposer, workload, startup, max_running=1, learn=True):
    """Throughput with speculation over throughput without, in simulated seconds; and
    the speculating run."""
    runs = []
    for speculate in (False, True):
        clock = FakeClock()
        engine = SimulatedEngine(clock, real_step, None, max_running)
        for rid, prompt, continuation in workload:
            engine.add(rid, prompt, continuation)
        if speculate:
            engine.controller = controller(make_proposer(engine, clock), clock, startup,
                                           learn=learn)
        runs.append(engine.run())
    plain, spec = runs
    assert spec.tokens == plain.tokens
    return spec.tok_s / plain.tok_s, spec


def lookup(seconds_per_request=0.0003):
    return lambda engine, clock: ChargedProposer(NgramProposer(), clock, seconds_per_request)


def always_wrong(engine, clock):
    return GuessingProposer(engine, 0.0, clock, seconds_per_request=0.0003)


def dear_draft_model(engine, clock):
    """Half its drafts right, but a pass costs 8 ms where start-up measured 0.5 ms."""
    return FakeDraftModel(engine, 0.5, clock, startup_pass_s=0.0005, real_pass_s=0.008)


USELESS = {
    "random ids, prompt lookup, one at a time": (lookup(), random_workload(5),
                                                 FLAT_STARTUP, 1),
    "random ids, prompt lookup, 16 at once": (lookup(), random_workload(32), FLAT_STARTUP,
                                              16),
    "always-wrong drafts, one at a time": (always_wrong, random_workload(5), FLAT_STARTUP,
                                           1),
    "always-wrong drafts, 16 at once": (always_wrong, random_workload(32), FLAT_STARTUP, 16),
    "a draft model dearer than measured, one at a time": (dear_draft_model,
                                                           random_workload(5), TRUE_STARTUP,
                                                           1),
    "a draft model dearer than measured, 16 at once": (dear_draft_model, random_workload(32),
                                                        TRUE_STARTUP, 16),
}


@pytest.mark.parametrize("case", list(USELESS), ids=list(USELESS))
def test_useless_drafts_cost_at_most_two_percent(case):
    make_proposer, workload, startup, max_running = USELESS[case]
    ratio, run = speedup(make_proposer, workload, startup, max_running)
    assert ratio >= 0.98, f"{case}: {ratio:.3f}x of no speculation"
    assert run.drafted_share(after=40) <= 0.08, run.drafted_share(after=40)  # trials only
    unmeasured, _ = speedup(make_proposer, workload, startup, max_running, learn=False)
    assert unmeasured < 0.98, f"{case} is no slowdown even unmeasured ({unmeasured:.3f}x)"


@pytest.mark.parametrize("max_running, least", [(1, 3.0), (16, 1.5)])
def test_prompt_lookup_still_pays_on_repetitive_text(max_running, least):
    ratio, run = speedup(lookup(), repetitive_workload(2 * max_running + 3), TRUE_STARTUP,
                         max_running)
    assert ratio >= least, f"{ratio:.2f}x"
    assert run.drafted_share() >= 0.9


def test_a_draft_model_that_pays_keeps_drafting():
    def good_draft_model(engine, clock):  # 90 % right, a pass a fifth of a step
        return FakeDraftModel(engine, 0.9, clock, startup_pass_s=0.002, real_pass_s=0.002)
    ratio, run = speedup(good_draft_model, random_workload(5), TRUE_STARTUP)
    assert ratio >= 1.5 and run.drafted_share() >= 0.9, (ratio, run.drafted_share())


def test_drafting_resumes_once_the_text_turns_repetitive():
    """200 random tokens, then a pattern repeated: drafting stops, then comes back at the
    first trial that finds it pays (trials of prompt lookup that find nothing cost next
    to nothing: they come every TRIAL_GAP_MIN steps)."""
    pattern = random_tokens(23, 7)
    continuation = random_tokens(200, 8) + (pattern * 40)[:600]
    clock = FakeClock()
    engine = SimulatedEngine(clock, real_step)
    engine.add("turning", random_tokens(100, 9), continuation)
    engine.controller = controller(lookup()(engine, clock), clock, TRUE_STARTUP)
    run = engine.run()
    assert sum(run.drafted[20:200]) <= 12  # the random part: only trials
    first_repeat = 201 + len(pattern)  # a step a token while nothing is drafted
    resumed = run.drafted.index(True, first_repeat)
    assert resumed - first_repeat <= TRIAL_GAP_MIN + TRIAL_STEPS
    assert run.drafted_share(after=resumed) >= 0.9


def test_the_real_pass_time_replaces_the_start_up_measurement():
    clock = FakeClock()
    engine = SimulatedEngine(clock, real_step)
    for rid, prompt, continuation in random_workload(2):
        engine.add(rid, prompt, continuation)
    engine.controller = controller(dear_draft_model(engine, clock), clock, TRUE_STARTUP)
    engine.run()
    assert engine.controller.pass_scale == pytest.approx(0.008 / 0.0005, rel=0.01)


# -- the gate and the baseline on their own ------------------------------------------------

def test_the_baseline_learns_plain_steps_by_row_band():
    startup = StepCostModel({1: 0.01, 512: 0.03})
    baseline = StepBaseline(startup)
    assert baseline.ratio(1) == 1.0 and not baseline.knows(1)
    for _ in range(BASELINE_MIN):                   # plain one-row steps: twice as long
        baseline.observe(1, 0.02)
    assert baseline.knows(1) and baseline.knows(2) and not baseline.knows(8)
    assert baseline.seconds(1) == pytest.approx(0.02)
    assert baseline.ratio(300) == 2.0               # the nearest measured band stands in
    baseline.observe(256, 3 * startup(256))         # one step is not enough to stand in
    assert baseline.ratio(300) == 2.0 and not baseline.knows(300)
    for _ in range(BASELINE_MIN - 1):
        baseline.observe(256, startup(256))
    assert baseline.ratio(300) == 1.0 and baseline.ratio(1) == 2.0
    baseline.observe(1, 10.0)                       # one stalled step: the median holds
    assert baseline.ratio(1) == 2.0
    for _ in range(BASELINE_STEPS):                 # steps that really got slower move it
        baseline.observe(1, 0.03)
    assert baseline.ratio(1) == pytest.approx(3.0)


def ONE_ROW() -> int:
    """The rows of the coming step, as the gate asks for them."""
    return 1


def _step(seconds, drafted=True, tokens=2, accepted=1, rows=3):
    """A one-request step: with drafts (2 of them) or plain, from a planner or not."""
    return MeasuredStep(planned=drafted, rows=rows if drafted else 1,
                        draft_rows=2 if drafted else 0, tokens=tokens if drafted else 1,
                        accepted=accepted if drafted else 0, seconds=seconds,
                        proposing_seconds=0.0)


def _known_gate(plain_seconds=0.010) -> DraftingGate:
    baseline = StepBaseline(StepCostModel({1: 0.001, 512: 0.5}))  # start-up: wrong
    for _ in range(BASELINE_MIN):
        baseline.observe(1, plain_seconds)
    return DraftingGate(baseline)


def _confirm(gate: DraftingGate, plain_seconds: float = 0.010) -> None:
    """The plain steps the gate asks for before it stops drafting."""
    for _ in range(CONFIRM_STEPS):
        assert gate.open and gate.mode(ONE_ROW) is StepMode.PLAIN
        gate.observe(_step(plain_seconds, drafted=False))


def test_the_gate_stops_drafting_once_measured_yield_is_below_its_cost():
    gate = _known_gate()  # a plain step: 1 token in 10 ms
    assert gate.mode(ONE_ROW) is StepMode.TRIAL
    for _ in range(TRIAL_STEPS - 1):  # 2 tokens in 21 ms: 0.95x, not yet trusted
        gate.observe(_step(0.021))
        assert gate.open and gate.mode(ONE_ROW) is StepMode.TRIAL
    gate.observe(_step(0.021))
    _confirm(gate)  # plain steps still take 10 ms: the loss holds
    assert not gate.open and gate.mode(ONE_ROW) is StepMode.PLAIN


def test_a_loss_against_a_stale_baseline_does_not_stop_drafting():
    """Plain steps measured at 5 ms, then the machine gets busier: 2 tokens in 12 ms look
    like a loss against 5 ms, but the plain steps measured before stopping take 10 ms,
    and against those the same steps gain 1.67x."""
    gate = _known_gate(plain_seconds=0.005)
    for _ in range(TRIAL_STEPS):
        gate.observe(_step(0.012))
    assert gate.mode(ONE_ROW) is StepMode.PLAIN  # asks for a fresh baseline first
    for _ in range(CONFIRM_STEPS):  # 2 of the baseline's 3 plain steps now take 10 ms
        gate.observe(_step(0.010, drafted=False))
    assert gate.open and gate.mode(ONE_ROW) is StepMode.PLAN
    assert gate.measured_ratio == pytest.approx(2 / 1.2)


def test_drafts_never_accepted_stop_even_against_a_stale_slow_baseline():
    """Plain steps measured at 10 ms, then the machine gets faster: drafted steps take
    4 ms and no draft is accepted. Verifying drafts never makes a step faster, so the
    steps cost at least a plain step, plus proposing: a loss, whatever the baseline."""
    gate = _known_gate(plain_seconds=0.010)
    for _ in range(TRIAL_STEPS):
        gate.observe(MeasuredStep(planned=True, rows=3, draft_rows=2, tokens=1,
                                  accepted=0, seconds=0.0045, proposing_seconds=0.0005))
    _confirm(gate, plain_seconds=0.010)
    assert not gate.open


def test_a_clear_loss_stops_drafting_sooner_and_a_gain_keeps_it():
    gate = _known_gate()
    clear_loss = 0.010 * 2 / CLEAR_LOSS * 1.05  # seconds of 2 tokens, just below CLEAR_LOSS
    gate.observe(_step(clear_loss))
    assert gate.mode(ONE_ROW) is StepMode.TRIAL  # one step is no evidence: it may stall
    gate.observe(_step(clear_loss))
    _confirm(gate)
    assert not gate.open
    paying = _known_gate()
    for _ in range(100):
        mode = paying.mode(ONE_ROW)
        assert mode is not StepMode.PLAIN or paying.open  # plain only to probe
        drafted = mode is not StepMode.PLAIN
        paying.observe(_step(0.012 if drafted else 0.010, drafted))  # 1.67x
    assert paying.open and paying.measured_ratio == pytest.approx(0.010 * 2 / 0.012)


def test_stalled_steps_do_not_stop_drafting_that_pays():
    """Steps of 2 tokens in 12 ms (1.67x), two of nine stalled for 5 s and 0.5 s: the
    median step is what drafting costs, and drafting that pays goes on."""
    gate = _known_gate()
    for seconds in [0.012] * 3 + [5.0] + [0.012] * 2 + [0.5] + [0.012] * 2:
        gate.observe(_step(seconds))
    assert gate.open and gate.measured_ratio == pytest.approx(2 / 1.2)


def _proposing_step(proposing: float) -> MeasuredStep:
    """2 tokens (1 accepted draft) whose model step takes 11 ms, after ``proposing``."""
    return MeasuredStep(planned=True, rows=3, draft_rows=2, tokens=2, accepted=1,
                        seconds=0.011 + proposing, proposing_seconds=proposing)


def test_proposing_dear_in_every_step_stops_drafting():
    gate = _known_gate()  # 1.1 plain steps of model and 0.95 of proposing: 2 tokens lose
    for _ in range(TRIAL_STEPS):
        gate.observe(_proposing_step(0.0095))
    _confirm(gate)
    assert not gate.open


def test_a_stall_while_proposing_counts_as_at_most_a_few_typical_proposals():
    gate = _known_gate()
    for _ in range(EVIDENCE_STEPS - 1):
        gate.observe(_proposing_step(0.001))
    gate.observe(_proposing_step(0.5))  # a collection, another process: half a second
    typical_cost = 1.1 + (EVIDENCE_STEPS - 1 + STALL) * 0.001 / (EVIDENCE_STEPS * 0.010)
    assert gate.open and gate.measured_ratio == pytest.approx(2 / typical_cost)


def _wait_after_a_trial(gate: DraftingGate, step_seconds: float) -> int:
    """Plain steps until the next trial, after planned steps of 2 tokens in
    ``step_seconds`` until the gate closes."""
    while gate.open:
        drafted = gate.mode(ONE_ROW) is not StepMode.PLAIN
        gate.observe(_step(step_seconds if drafted else 0.010, drafted))
    wait = 1
    while gate.mode(ONE_ROW) is StepMode.PLAIN:
        gate.observe(_step(0.010, drafted=False))
        wait += 1
    assert gate.open
    return wait


def test_trials_that_do_not_pay_come_seldom_enough_to_cost_one_percent():
    gate = _known_gate()
    # 3 steps of 2 tokens in 22 ms where a plain step gives 1 in 10: each loses 0.2 of a
    # plain step, 0.6 in all; at most 1 % of the time: one trial in 60 steps
    assert _wait_after_a_trial(gate, 0.022) == round(3 * 0.2 / TRIAL_BUDGET) == 60
    # 2 steps of 2 tokens in 30 ms, a clear loss: 2 steps lost, one trial in 200 steps
    assert _wait_after_a_trial(gate, 0.030) == 200
    assert _wait_after_a_trial(gate, 0.021) == TRIAL_GAP_MIN   # 0.3 lost: 30, at least
    assert _wait_after_a_trial(gate, 0.500) == TRIAL_GAP_MAX   # 96 lost: 9600, at most


def test_while_every_step_drafts_one_is_left_plain_for_the_baseline():
    gate = _known_gate()
    modes = []
    for _ in range(2 * PROBE_EVERY + 2):
        mode = gate.mode(ONE_ROW)
        modes.append(mode)
        gate.observe(_step(0.012, drafted=mode is not StepMode.PLAIN))
    plain = [i for i, m in enumerate(modes) if m is StepMode.PLAIN]
    assert plain == [PROBE_EVERY, 2 * PROBE_EVERY + 1]


def test_an_unmeasured_row_count_is_probed_before_drafting():
    gate = DraftingGate(StepBaseline(StepCostModel({1: 0.01, 512: 0.3})))
    for _ in range(BASELINE_MIN):  # not measured enough: learn the plain step first
        assert gate.mode(ONE_ROW) is StepMode.PLAIN
        gate.observe(_step(0.01, drafted=False))
    assert gate.mode(ONE_ROW) is StepMode.TRIAL
    assert gate.mode(lambda: 64) is StepMode.PLAIN  # far from any measured band
