"""Draft limits follow the measured step cost and each request's acceptance."""
from __future__ import annotations

import pytest

from kvserve.config.speculative import SpeculativeConfig
from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.controller import SpecDecodeController, StepCostModel
from kvserve.spec_decode.ngram import NgramProposer

CONFIG = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def _decoding(rid: str, outputs: int = 1, max_tokens: int = 50) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), None,
                  max_tokens=max_tokens)
    req.output_token_ids = [5] * outputs
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _controller(costs: dict[int, float]) -> SpecDecodeController:
    return SpecDecodeController(CONFIG, NgramProposer(), StepCostModel(costs), 2048)


def test_cost_model_interpolates_extrapolates_and_never_falls():
    cost = StepCostModel({1: 1.0, 4: 1.3, 8: 1.2, 16: 2.0})
    assert cost(2) == pytest.approx(1.1)
    assert cost(8) == pytest.approx(1.3)  # a noisy dip smoothed to the level before
    assert cost(32) == pytest.approx(2.0 + 0.7 / 8 * 16)


def test_cheap_rows_give_every_request_its_full_drafts():
    ctl = _controller({1: 1.0, 64: 1.05})  # memory bound: rows nearly free
    reqs = [_decoding(str(i)) for i in range(3)]
    assert ctl.draft_limits(reqs) == {"0": 4, "1": 4, "2": 4}


def test_rows_that_cost_their_share_give_no_drafts():
    ctl = _controller({1: 0.01, 512: 5.12})  # compute bound: time proportional to rows
    assert ctl.draft_limits([_decoding(str(i)) for i in range(64)]) == {}


def test_requests_whose_drafts_fail_lose_them_and_max_tokens_caps():
    ctl = _controller({1: 1.0, 8: 1.1, 16: 1.6})
    good, bad, last = _decoding("good"), _decoding("bad"), _decoding("last", 9, max_tokens=11)
    out = SchedulerOutput([ScheduledRequest("good", [1] * 5, 3, [0], None, 4),
                           ScheduledRequest("bad", [1] * 5, 3, [0], None, 4)])
    for _ in range(5):
        ctl.record(out, {"good": [0] * 5, "bad": [0]})  # good: all 4 accepted; bad: none
    assert ctl.acceptance("good") > 0.8 > 0.2 > ctl.acceptance("bad")
    limits = ctl.draft_limits([good, bad, last])
    assert limits["good"] == 4 and "bad" not in limits
    assert limits["last"] == 1  # 2 tokens left: one draft plus the step's own token
    assert ctl.stats.num_drafts == 10 and ctl.stats.num_draft_tokens == 40
    assert ctl.stats.num_accepted_tokens == 20
    assert ctl.stats.accepted_per_position == [5, 5, 5, 5]


class _DearPasses(NgramProposer):
    """A proposer whose every pass costs ten times a step."""
    cost_unit = "pass"

    def pass_cost(self, num_requests: int) -> float:
        return 10.0


def test_a_proposer_too_dear_to_use_is_tried_now_and_then():
    from kvserve.spec_decode.controller import EXPLORE_STEPS

    ctl = SpecDecodeController(CONFIG, _DearPasses(), StepCostModel({1: 1.0, 64: 1.05}), 2048)
    alone = [_decoding("alone")]
    given = [ctl.draft_limits(alone) for _ in range(2 * EXPLORE_STEPS)]
    tried = [i + 1 for i, limits in enumerate(given) if limits]
    assert tried == [EXPLORE_STEPS, 2 * EXPLORE_STEPS]
    assert given[EXPLORE_STEPS - 1] == {"alone": 1}


def test_a_pass_is_paid_once_by_all_the_requests_it_carries():
    """A pass costs the same for one request or eight: when drafting pays for one
    request alone it pays for eight together, though no single one of the eight's first
    drafts would pay for the whole pass."""
    class _SharedPasses(_DearPasses):
        def pass_cost(self, num_requests: int) -> float:
            return 0.3  # of a 1.0 s step; the prior acceptance is 0.5

    ctl = SpecDecodeController(CONFIG, _SharedPasses(), StepCostModel({1: 1.0, 64: 1.05}),
                               2048)
    assert ctl.draft_limits([_decoding("alone")])["alone"] >= 1
    eight = ctl.draft_limits([_decoding(str(i)) for i in range(8)])
    assert sorted(eight) == [str(i) for i in range(8)] and min(eight.values()) >= 1
