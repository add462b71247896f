"""The quality bench's window statistics on known inputs, and its texts load and are long enough."""

from __future__ import annotations

import math

import pytest

from ops.bench.quality import stats, texts


def test_t_interval_matches_hand_computation() -> None:
    # mean 3, sample sd sqrt(2.5), n 5, t(4) 2.776: half width 2.776 * sqrt(2.5) / sqrt(5)
    m, lo, hi = stats.t_interval([1, 2, 3, 4, 5])
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert m == 3 and lo == pytest.approx(3 - half) and hi == pytest.approx(3 + half)
    assert stats.t_interval([7.0]) == (7.0, 7.0, 7.0)


def test_t95_table_errs_wide_between_rows() -> None:
    assert stats.t95(23) == 2.069 and stats.t95(35) == 2.042 and stats.t95(500) == 1.96
    with pytest.raises(ValueError):
        stats.t95(0)


def test_ppl_delta_is_paired_and_maps_through_exp() -> None:
    exact = [3.0, 3.5, 2.8, 3.1]
    mode = [x + 0.01 for x in exact]  # the same shift in every window: no spread, whatever the windows
    d, lo, hi = stats.ppl_delta_interval(mode, exact)
    assert d == pytest.approx((math.exp(0.01) - 1) * 100) and lo == pytest.approx(d) and hi == pytest.approx(d)
    with pytest.raises(ValueError):
        stats.ppl_delta_interval([1.0], [1.0, 2.0])


def test_alike_neighbours_widen_the_interval_and_alternating_ones_narrow_nothing() -> None:
    exact = [0.0] * 8
    alike = [0.01, 0.012, 0.011, 0.02, 0.021, 0.019, 0.03, 0.031]  # neighbours alike: r > 0
    alternating = [0.01, 0.03, 0.011, 0.029, 0.012, 0.031, 0.009, 0.03]  # r < 0
    for diffs in (alike, alternating):
        m, lo, hi = stats.t_interval(diffs)
        r = stats.autocorrelation(diffs)
        widen = math.sqrt((1 + r) / (1 - r)) if r > 0 else 1.0
        d, dlo, dhi = stats.ppl_delta_interval(diffs, exact)
        assert d == pytest.approx((math.exp(m) - 1) * 100)
        assert dhi == pytest.approx((math.exp(m + (hi - m) * widen) - 1) * 100)
        assert dlo == pytest.approx((math.exp(m - (m - lo) * widen) - 1) * 100)
    assert stats.autocorrelation(alike) > 0.3 and stats.autocorrelation(alternating) < 0


def test_autocorrelation_of_alike_neighbours_alternation_and_constants() -> None:
    assert stats.autocorrelation([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.25)  # (−1.5·−0.5 + ... ) / 5
    assert stats.autocorrelation([1.0, -1.0] * 4) == pytest.approx(-7 / 8)
    assert stats.autocorrelation([1.0, 2.0, 1.0, 2.0], lag=2) == pytest.approx(0.5)
    assert stats.autocorrelation([3.0] * 5) == 0.0 and stats.autocorrelation([1.0], lag=1) == 0.0


def test_quantiles_and_distribution_follow_numpy_linear() -> None:
    xs = [32, 0, 10, 20, 30]
    dist = stats.distribution(xs)
    assert dist == {"min": 0, "p10": 4.0, "median": 20, "mean": 18.4, "max": 32}


def test_bootstrap_is_seeded_and_brackets_the_statistic() -> None:
    xs = [float(i) for i in range(24)]
    lo, hi = stats.bootstrap(xs, stats.mean, reps=500, seed=1)
    assert (lo, hi) == stats.bootstrap(xs, stats.mean, reps=500, seed=1)
    assert lo < stats.mean(xs) < hi


def test_sets_are_disjoint_and_every_text_loads() -> None:
    cal = {t.name for t in texts.CALIBRATION}
    held = {t.name for t in texts.HELD_OUT}
    assert not cal & held
    kinds = " ".join(t.kind for t in texts.HELD_OUT)
    for kind in ("prose", "dialogue", "code", "non-English"):
        assert kind in kinds
    for t in texts.SETS["all"]:
        assert len(texts.read(t)) > 5000, t.name  # over 768 tokens: a window fits with room to spread windows


def test_resolve_names_sets_files_and_refuses_the_rest(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "mine.txt"
    f.write_text("hello", encoding="utf-8")
    got = texts.resolve(["held-out", "declaration", str(f)])
    assert [t.name for t in got] == ["alice", "twelfthnight", "difflib.py", "froschkoenig", "declaration",
                                         "mine.txt"]
    assert texts.read(got[-1]) == "hello"
    with pytest.raises(SystemExit, match="no text 'nope'"):
        texts.resolve(["nope"])
