"""Gap model: log-normal maths, conditional resume probability, online fit, fallbacks."""

from __future__ import annotations

import math
import random

import pytest

from policy.gaps import ANY, GapConfig, GapDistribution, GapModel

MED30 = GapDistribution(mu=math.log(30.0), sigma=1.0, p_return=1.0)
HALF = GapDistribution(mu=math.log(30.0), sigma=1.0, p_return=0.5)


@pytest.mark.parametrize(
    ("dist", "t", "elapsed", "expected"),
    [
        (MED30, 30.0, 0.0, 0.5),
        (HALF, 30.0, 0.0, 0.25),
        (MED30, 0.0, 0.0, 0.0),
        (MED30, 1e12, 30.0, 1.0),  # it returns for sure, and has not yet
        (HALF, 1e12, 30.0, 1.0 / 3.0),  # 0.5 * 0.5 / (1 - 0.25)
        (GapDistribution(0.0, 1.0, 0.0), 1e6, 0.0, 0.0),  # never returns
    ],
)
def test_p_resume_within(dist: GapDistribution, t: float, elapsed: float, expected: float) -> None:
    assert dist.p_resume_within(t, elapsed) == pytest.approx(expected, abs=1e-9)


def test_quantiles_and_median_remaining() -> None:
    assert MED30.quantile(0.5) == pytest.approx(30.0)
    assert MED30.quantile(0.8413447) == pytest.approx(30.0 * math.e, rel=1e-5)
    assert MED30.cdf(30.0 * math.e) == pytest.approx(0.8413447, rel=1e-6)
    assert MED30.median_remaining(0.0) == pytest.approx(30.0)
    # Having waited 30 s (the median), the rest is the 75% quantile minus 30 s.
    assert MED30.median_remaining(30.0) == pytest.approx(MED30.quantile(0.75) - 30.0)


@pytest.mark.parametrize(
    ("dist", "window", "expected"),
    [
        (GapDistribution(0.0, 1.0, 0.0), 100.0, 100.0),  # never returns: the whole window
        # sharp gap ~10 s: E[min(T, 100)] = E[T] = 10 * exp(0.1**2 / 2)
        (GapDistribution(math.log(10.0), 0.1, 1.0), 100.0, 10.0 * math.exp(0.005)),
        (MED30, 0.0, 0.0),
    ],
)
def test_expected_wait_within_exact(dist: GapDistribution, window: float, expected: float) -> None:
    assert dist.expected_wait_within(window) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("dist", "window", "elapsed"),
    [(HALF, 300.0, 0.0), (HALF, 86400.0, 45.0), (MED30, 60.0, 120.0), (MED30, 10.0, 1.0)],
)
def test_expected_wait_within_matches_the_survival_integral(
    dist: GapDistribution, window: float, elapsed: float
) -> None:
    """The closed form equals a fine numerical integral of the conditional survival function."""
    n = 20000
    h = window / n
    surv = [1.0 - dist.p_resume_within(i * h, elapsed) for i in range(n + 1)]
    numeric = h * (sum(surv) - 0.5 * (surv[0] + surv[-1]))
    assert dist.expected_wait_within(window, elapsed) == pytest.approx(numeric, rel=2e-3)


def test_empty_model_answers_the_prior() -> None:
    dist = GapModel(GapConfig(prior_median_s=30.0, prior_p_return=0.5)).distribution("a", "stop")
    assert dist.quantile(0.5) == pytest.approx(30.0)
    assert dist.p_return == 0.5
    assert dist.samples == 0.0


def test_fallback_chain() -> None:
    model = GapModel(GapConfig(decay=1.0, min_samples=3))
    for _ in range(4):
        model.observe("coder", "tool_calls", 10.0)
    for agent, reason in [
        ("coder", "tool_calls"),
        ("coder", "length"),
        ("writer", "tool_calls"),
        ("writer", "length"),
    ]:
        assert model.distribution(agent, reason).quantile(0.5) == pytest.approx(10.0)
    for _ in range(4):
        model.observe("writer", "length", 100.0)
    assert model.distribution("writer", "length").quantile(0.5) == pytest.approx(100.0)
    assert model.distribution("coder", "tool_calls").quantile(0.5) == pytest.approx(10.0)
    # (any, any) mixes both: geometric mean of 10 and 100
    assert model.distribution("other", "other").quantile(0.5) == pytest.approx(math.sqrt(1000.0))
    assert len(model) == 7  # 2 exact keys, 2 (agent, *), 2 (*, reason), (*, *)


def test_min_samples_counts_decayed_weight() -> None:
    model = GapModel(GapConfig(decay=0.95, min_samples=3, prior_median_s=30.0))
    for _ in range(3):  # weight 1 + 0.95 + 0.9025 < 3: not trusted yet
        model.observe("a", "stop", 5.0)
    assert model.distribution("a", "stop").quantile(0.5) == pytest.approx(30.0)
    model.observe("a", "stop", 5.0)
    assert model.distribution("a", "stop").quantile(0.5) == pytest.approx(5.0)
    assert model.distribution("a", "stop").sigma == 0.1  # min_sigma floor


def test_p_return_counts_abandons() -> None:
    model = GapModel(GapConfig(decay=1.0))
    for _ in range(4):
        model.observe("a", "stop", 20.0)
        model.observe_abandon("a", "stop")
    dist = model.distribution("a", "stop")
    assert dist.p_return == pytest.approx(5.0 / 10.0)
    assert model.p_resume_within("a", "stop", 20.0) == pytest.approx(0.25)


def test_online_fit_recovers_lognormal_parameters() -> None:
    rng = random.Random(1)
    model = GapModel(GapConfig(decay=1.0))
    for _ in range(2000):
        model.observe("a", "tool_calls", rng.lognormvariate(math.log(20.0), 0.8))
    dist = model.distribution("a", "tool_calls")
    assert dist.mu == pytest.approx(math.log(20.0), abs=0.05)
    assert dist.sigma == pytest.approx(0.8, abs=0.05)


def test_keys_are_bounded() -> None:
    model = GapModel(GapConfig(max_keys=6))
    for i in range(10):
        model.observe(f"agent{i}", "stop", 1.0)
    assert len(model) <= 6
    assert model.distribution(ANY, ANY).samples > 0  # the global level survives


@pytest.mark.parametrize(
    "kwargs", [{"decay": 0.0}, {"prior_median_s": 0.0}, {"min_sigma": 0.0}, {"max_keys": 3}]
)
def test_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        GapConfig(**kwargs)  # type: ignore[arg-type]
