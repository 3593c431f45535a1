"""The one paired statistic: the median of per-round ratios, with their min and max."""
from __future__ import annotations

import math

import pytest

from kvserve.bench.instruments.paired import (PairedRatio, describe_ratio, paired_ratio,
                                              ratio_cell, summarize_ratios)


def test_median_min_max_of_the_rounds_ratios() -> None:
    ratio = paired_ratio([12.0, 10.0, 30.0], [10.0, 10.0, 20.0])  # 1.2, 1.0, 1.5
    assert ratio == PairedRatio(1.2, 1.0, 1.5, 3, (1.2, 1.0, 1.5))
    assert ratio.to_dict() == {"median": 1.2, "min": 1.0, "max": 1.5, "rounds": 3,
                               "per_round": [1.2, 1.0, 1.5]}
    # not the ratio of the medians (12 / 20 = 0.6 here): a slow round for one side
    # moves that round's ratio, not the statistic
    assert paired_ratio([12.0, 10.0, 30.0], [10.0, 20.0, 20.0]).median == pytest.approx(1.2)
    even = paired_ratio([2.0, 3.0, 5.0, 8.0], [1.0, 1.0, 1.0, 1.0])
    assert (even.median, even.min, even.max) == (4.0, 2.0, 8.0)  # mean of the middle two


def test_a_round_either_side_failed_is_dropped_from_both() -> None:
    ratio = paired_ratio([10.0, None, 30.0, 40.0], [5.0, 9.0, float("nan"), 10.0])
    assert ratio.per_round == (2.0, 4.0) and ratio.rounds == 2
    assert ratio.median == 3.0 and (ratio.min, ratio.max) == (2.0, 4.0)
    assert paired_ratio([1.0, 2.0], [0.0, 1.0]).per_round == (2.0,)  # nothing measured
    assert paired_ratio([None, 1.0], [1.0, None]) is None
    assert paired_ratio([], []) is None


def test_unequal_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="equally many figures a side, got 3 and 2"):
        paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


def test_ratios_taken_elsewhere_and_the_printed_forms() -> None:
    ratio = summarize_ratios([1.31, None, 1.18, math.nan, 1.23])
    assert (ratio.median, ratio.min, ratio.max, ratio.rounds) == (1.23, 1.18, 1.31, 3)
    assert ratio.describe() == "1.23x (median of 3 rounds' ratios; 1.18–1.31)"
    assert ratio.cell() == ratio_cell(ratio) == "1.23x (1.18–1.31)"
    one = summarize_ratios([0.5])
    assert one.describe() == "0.50x (median of 1 round's ratio; 0.50–0.50)"
    assert ratio_cell(None) == "-" and describe_ratio(None) == "no round measured both sides"
    assert describe_ratio(one) == one.describe()
