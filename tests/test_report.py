"""report.py: which training curves a stage's plot shows, and that the PNG is written."""

from __future__ import annotations

import json

from alignment.evaluation.report import MAX_CURVES, curve_keys, plot_training_curves

# The keys one PPO update logs (stages/ppo.py), in the order it logs them.
PPO_ENTRY = {
    "update": 1,
    "episodes": 8,
    "score": 0.4,
    "score_std": 0.2,
    "rm_score": 0.3,
    "verifier/arithmetic": 0.5,
    "kl": 0.01,
    "entropy": 2.0,
    "policy_loss": -0.1,
    "value_loss": 0.3,
    "clipfrac": 0.0,
    "approx_kl": 0.001,
    "ref_kl": 0.02,
    "kl_coef": 0.05,
    "learning_rate": 1e-5,
    "rollout_tokens_per_s": 100.0,
}


def test_ppo_curves_show_the_scores_first():
    keys = curve_keys([PPO_ENTRY, {**PPO_ENTRY, "update": 2, "score": 0.6}])
    assert keys[:3] == ["score", "rm_score", "verifier/arithmetic"]
    assert "kl" in keys and "policy_loss" in keys and len(keys) == MAX_CURVES
    assert "score_std" not in keys  # a spread, after the means, cut by the panel limit
    assert "learning_rate" not in keys and "update" not in keys


def test_trl_curves_keep_log_order_with_spreads_last():
    history = [{"loss": 1.0, "rewards/margins_std": 0.1, "rewards/margins": 0.2, "step": 1}]
    assert curve_keys(history) == ["loss", "rewards/margins", "rewards/margins_std"]


def test_training_curves_png_is_written_per_stage(tmp_path):
    stage = tmp_path / "ppo"
    stage.mkdir()
    (stage / "log_history.json").write_text(json.dumps([PPO_ENTRY, {**PPO_ENTRY, "update": 2}]))
    (tmp_path / "empty").mkdir()
    written = plot_training_curves({"ppo": stage, "empty": tmp_path / "empty"}, tmp_path)
    assert written == [tmp_path / "curves_ppo.png"] and written[0].read_bytes()[:4] == b"\x89PNG"


def test_overoptimisation_plot_from_a_synthetic_log_history(tmp_path):
    """Gold and proxy against KL (Gao et al. 2022), one panel per RL stage: ppo's keys (`kl`, `rm_score`,
    `gold/<name>`) and rlvr's (TRL's `kl`, `rewards/reward_model/mean`); stages without KL are left out."""
    from alignment.evaluation.report import (
        overoptimisation_series,
        plot_overoptimisation,
    )

    # The proxy keeps rising while the gold peaks and falls: the over-optimisation curve.
    ppo = [
        {**PPO_ENTRY, "update": i, "kl": kl, "rm_score": 0.5 * kl, "gold/arithmetic": gold}
        for i, (kl, gold) in enumerate([(0.0, 0.6), (1.0, 0.8), (2.0, 0.9), (4.0, 0.7), (8.0, 0.4)], 1)
    ]
    rlvr = [{"step": s, "kl": 0.01 * s, "rewards/reward_model/mean": 0.1 * s, "gold/arithmetic": 0.5} for s in (1, 2)]
    rlvr.append({"train_runtime": 10.0, "step": 2})  # TRL's closing entry: no KL
    folders = {}
    for name, history in [("ppo", ppo), ("rlvr", rlvr), ("sft", [{"loss": 1.0, "step": 1}])]:
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "log_history.json").write_text(json.dumps(history))
    series = overoptimisation_series(ppo)
    assert series["kl"] == [0.0, 1.0, 2.0, 4.0, 8.0] and series["proxy"] == {"rm_score": [0.0, 0.5, 1.0, 2.0, 4.0]}
    assert series["gold"] == {"gold/arithmetic": [0.6, 0.8, 0.9, 0.7, 0.4]}
    assert overoptimisation_series(rlvr)["proxy"] == {"rewards/reward_model/mean": [0.1, 0.2]}
    assert overoptimisation_series([{"loss": 1.0}]) is None
    path = plot_overoptimisation(folders, tmp_path / "overoptimisation.png")
    assert path == tmp_path / "overoptimisation.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert plot_overoptimisation({"sft": folders["sft"]}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
