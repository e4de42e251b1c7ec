"""Next-agent Markov model: smoothing, decay, bounds, hop distances, online accuracy."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from itertools import pairwise

import pytest

from policy.predictor import TransitionConfig, TransitionModel


def trained(pairs: Sequence[tuple[str | None, str]], **cfg: float) -> TransitionModel:
    model = TransitionModel(TransitionConfig(**cfg))  # type: ignore[arg-type]
    for prev, nxt in pairs:
        model.observe(prev, nxt)
    return model


def test_empty_model_predicts_nothing() -> None:
    assert TransitionModel().predict("a") == []
    assert TransitionModel().probability("a", "b") == 0.0


def test_add_alpha_smoothing() -> None:
    model = trained([("a", "b")] * 3 + [("a", "c")], alpha=0.1, decay=1.0)
    preds = model.predict("a")
    assert [a for a, _ in preds] == ["b", "c", "a"]
    assert preds[0][1] == pytest.approx(3.1 / 4.3)
    assert preds[1][1] == pytest.approx(1.1 / 4.3)
    assert preds[2][1] == pytest.approx(0.1 / 4.3)
    assert sum(p for _, p in preds) == pytest.approx(1.0)
    assert model.predict("a", top_k=1) == [preds[0]]
    assert model.probability("a", "c") == pytest.approx(1.1 / 4.3)
    assert model.probability("a", "nobody") == 0.0


@pytest.mark.parametrize("prev", [None, "never-seen", "c"])
def test_unknown_or_empty_row_falls_back_to_marginal(prev: str | None) -> None:
    model = trained([(None, "b"), ("a", "b"), ("a", "b"), ("a", "c")], alpha=0.1, decay=1.0)
    preds = dict(model.predict(prev))
    # marginal of next agents: b x3, c x1 over K = 3 known agents
    assert preds["b"] == pytest.approx(3.1 / 4.3)
    assert preds["c"] == pytest.approx(1.1 / 4.3)


def test_decay_follows_a_routing_change() -> None:
    model = trained([("a", "b"), ("a", "b"), ("a", "c")], alpha=0.1, decay=0.5)
    # row a: b = (1 * 0.5 + 1) * 0.5 = 0.75, c = 1.0
    assert model.predict("a")[0][0] == "c"
    assert model.probability("a", "c") == pytest.approx(1.1 / 2.05)


def test_bounded_identities_forget_least_recent() -> None:
    model = trained([("a", "b"), ("b", "c"), ("c", "d")], max_agents=3)
    assert model.agents == ("b", "c", "d")
    assert "a" not in dict(model.predict("b"))
    assert model.predict("a") == model.predict(None)  # its row is gone too


def test_hop_distances_over_a_pipeline() -> None:
    seq = ["a", "b", "c", "d"] * 5
    model = trained(list(pairwise(seq)), decay=1.0)
    assert model.hop_distances("a") == {"b": 1, "c": 2, "d": 3, "a": 4}
    assert model.hop_distances("a", max_hops=2) == {"b": 1, "c": 2}
    assert model.hop_distances("a", min_prob=0.99) == {}
    assert model.hop_distances("zzz") == {}


def test_state_round_trip_is_json() -> None:
    model = trained([("a", "b"), ("b", "a"), ("a", "c")])
    state = json.loads(json.dumps(model.to_state()))
    clone = TransitionModel.from_state(state)
    assert clone.predict("a") == model.predict("a")
    assert clone.agents == model.agents
    clone.observe("c", "a")  # keeps learning after a restore
    assert clone.probability("c", "a") > model.probability("c", "a")


def test_online_top1_accuracy_on_a_noisy_supervisor_workflow() -> None:
    """A supervisor routes to one of 5 workers, each worker returns to the supervisor (80% of
    the time; else to a random agent). Seeded, so the figure is exact and repeatable."""
    rng = random.Random(0)
    agents = ["sup", "w1", "w2", "w3", "w4", "w5"]
    route = {"sup": "w1", "w1": "w2", "w2": "sup", "w3": "sup", "w4": "w5", "w5": "sup"}
    model = TransitionModel()
    prev, hits, n = "sup", 0, 300
    for _ in range(n):
        nxt = route[prev] if rng.random() < 0.8 else rng.choice(agents)
        top = model.predict(prev, top_k=1)
        hits += bool(top) and top[0][0] == nxt
        model.observe(prev, nxt)
        prev = nxt
    accuracy = hits / n
    assert 0.70 <= accuracy <= 0.85  # ~ the 80% determinism minus the learning phase


@pytest.mark.parametrize(
    "kwargs", [{"alpha": 0.0}, {"decay": 0.0}, {"decay": 1.5}, {"max_agents": 1}]
)
def test_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        TransitionConfig(**kwargs)  # type: ignore[arg-type]
