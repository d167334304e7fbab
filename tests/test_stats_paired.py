"""attnlab.stats.paired_difference: the paired comparison the press anchor reports (docs/press.md)."""
import pytest

from attnlab.errors import AttnlabError
from attnlab.stats import paired_difference


def test_a_constant_shift_is_exact_and_significant():
    x = [10.0, 50.0, 0.0, 100.0, 30.0, 70.0, 20.0, 40.0]
    r = paired_difference([v + 5 for v in x], x)
    assert r["mean"] == r["lo"] == r["hi"] == 5.0
    assert (r["wins"], r["losses"], r["ties"]) == (8, 0, 0)
    assert r["sign_p"] == pytest.approx(2 / 2 ** 8)  # exact binomial: 8 of 8 the same way


def test_identical_methods_show_no_difference():
    x = [0.0, 100.0, 25.0, 0.0]
    r = paired_difference(x, x)
    assert (r["mean"], r["lo"], r["hi"], r["sign_p"], r["ties"]) == (0.0, 0.0, 0.0, 1.0, 4)


def test_two_lucky_samples_are_not_a_significant_gain():
    # what 7 samples showed before (docs/press.md): +100 and +33 on two samples, the rest tied
    r = paired_difference([100.0, 33.3, 0, 0, 0, 0, 0], [0.0] * 7)
    assert r["mean"] == pytest.approx(19.04, abs=0.01)
    assert r["lo"] == 0.0 and r["hi"] > 40  # the interval reaches zero
    assert r["sign_p"] == pytest.approx(0.5)  # 2 of 2 the same way: p = 2 * 1/4


def test_the_interval_follows_the_seed_and_brackets_the_mean():
    x, y = [float(i % 3) * 40 for i in range(20)], [float(i % 2) * 30 for i in range(20)]
    a, b = paired_difference(x, y, seed=1), paired_difference(x, y, seed=1)
    assert a == b and a["lo"] <= a["mean"] <= a["hi"]
    with pytest.raises(AttnlabError):
        paired_difference([1.0], [1.0, 2.0])
