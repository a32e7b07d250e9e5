"""ppo's `early_stop:` on a gold measure: the watch by hand (window averages, new bests, patience), and on the tiny
model: the run stops when gold has not improved, the policy saved is the one that sampled the best window (here
the start policy, since the random model's arithmetic gold never rises above 0), resume keeps the best, and bad
settings are named."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_ppo_recipe

from alignment.config.recipe import load_recipe
from alignment.errors import UserError
from alignment.models.loading import load_policy
from alignment.run.runner import check_recipe, run_recipe
from alignment.stages import ppo
from alignment.training.early_stop import GoldWatch


def test_the_watch_compares_window_averages_and_counts_patience_from_the_best():
    watch = GoldWatch("gold/x", window=2, patience=3)
    new_best = [watch.observe(u, v) for u, v in enumerate([0.5, 0.7, 0.6, 0.4, 0.3, 0.2], start=1)]
    # averages: -, 0.6, 0.65, 0.5, 0.35, 0.25
    assert new_best == [False, True, True, False, False, False]
    assert watch.best == pytest.approx(0.65) and watch.best_update == 3
    assert [watch.exhausted(u) for u in (4, 5, 6)] == [False, False, True]
    again = GoldWatch("gold/x", window=2, patience=3)
    again.restore(json.loads(json.dumps(watch.state())))
    assert (again.values, again.best, again.best_update) == (watch.values, watch.best, watch.best_update)


def test_without_patience_the_watch_never_stops_and_before_a_full_window_nothing_is_best():
    watch = GoldWatch("gold/x", window=3, patience=None)
    assert not watch.observe(1, 1.0) and not watch.observe(2, 1.0) and watch.observe(3, 1.0)
    assert not any(watch.exhausted(u) for u in range(100))
    waiting = GoldWatch("gold/x", window=3, patience=2)
    assert not waiting.exhausted(4) and waiting.exhausted(5)  # counted from the first full window


def merged_weights(path) -> dict[str, torch.Tensor]:
    return load_policy(str(path)).state_dict()


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_stops_once_gold_stalls_and_saves_the_best_policy(tmp_path, tiny_model):
    path = tiny_ppo_recipe(
        tmp_path,
        tiny_model,
        gold=["arithmetic"],
        train={"total_updates": 4},
        early_stop={"gold": "arithmetic", "window": 1, "patience": 1},
    )
    metrics = run_recipe(load_recipe(path))["ppo"]["metrics"]
    out = tmp_path / "out" / "ppo"
    history = json.loads((out / "log_history.json").read_text())
    assert [h["gold/arithmetic"] for h in history] == [0.0]  # the random model never answers right
    assert metrics["early_stop/best_update"] == 1 and metrics["early_stop/stopped_at"] == 2
    assert metrics["early_stop/best_gold"] == 0.0 and metrics["updates"] == 1
    assert same_weights(merged_weights(out), merged_weights(tiny_model))  # the policy that sampled update 1


def test_without_patience_every_update_trains_and_the_best_policy_is_still_saved(tmp_path, tiny_model):
    runs = {}
    for name, extra in [("plain", {}), ("best", {"early_stop": {"gold": "arithmetic", "window": 1, "patience": None}})]:
        path = tiny_ppo_recipe(tmp_path / name, tiny_model, gold=["arithmetic"], **extra)
        runs[name] = run_recipe(load_recipe(path))["ppo"]["metrics"]
    assert runs["best"]["updates"] == 3 and runs["best"]["early_stop/stopped_at"] is None
    assert runs["best"]["early_stop/best_update"] == 1
    start = merged_weights(tiny_model)
    assert not same_weights(merged_weights(tmp_path / "plain" / "out" / "ppo"), start)  # training moved the policy
    assert same_weights(merged_weights(tmp_path / "best" / "out" / "ppo"), start)


def test_a_resumed_run_keeps_the_best_it_had_before_the_interruption(tmp_path, tiny_model, monkeypatch):
    path = tiny_ppo_recipe(
        tmp_path,
        tiny_model,
        gold=["arithmetic"],
        train={"total_updates": 4, "save_every": 1},
        early_stop={"gold": "arithmetic", "window": 1, "patience": None},
    )
    original = ppo.PPOLoop.one_update

    def interrupted(self):
        if self.update == 2:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(ppo.PPOLoop, "one_update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(load_recipe(path))
    assert (tmp_path / "out" / ".work" / "ppo" / "checkpoint-2" / ppo.BEST_POLICY).exists()
    monkeypatch.setattr(ppo.PPOLoop, "one_update", original)
    metrics = run_recipe(load_recipe(path))["ppo"]["metrics"]
    assert metrics["updates"] == 4 and metrics["early_stop/best_update"] == 1
    assert same_weights(merged_weights(tmp_path / "out" / "ppo"), merged_weights(tiny_model))


def test_early_stop_must_watch_one_of_the_gold_verifiers(tmp_path, tiny_model):
    with pytest.raises(UserError, match=r"stages\.ppo.*early_stop\.gold 'arithmetc' is not one of the stage's `gold:`"):
        load_recipe(tiny_ppo_recipe(tmp_path, tiny_model, gold=["arithmetic"], early_stop={"gold": "arithmetc"}))
    with pytest.raises(UserError, match="none given"):
        load_recipe(tiny_ppo_recipe(tmp_path, tiny_model, early_stop={"gold": "arithmetic"}))
    with pytest.raises(UserError, match="did you mean 'patience'"):
        load_recipe(
            tiny_ppo_recipe(tmp_path, tiny_model, gold=["arithmetic"], early_stop={"gold": "arithmetic", "patiense": 3})
        )
    # a module:function gold is logged under its resolved name, which `align check` compares
    check_recipe(
        load_recipe(
            tiny_ppo_recipe(
                tmp_path, tiny_model, gold=["my_rewards:brevity"], early_stop={"gold": "my_rewards:brevity"}
            )
        )
    )
