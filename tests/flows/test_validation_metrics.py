"""Validation as verl reports it (rollout.val_kwargs; val-core/<source>/<var>/mean@N, best@N,
maj@N with bootstrap std) through the validate stage, and the summary artifact's table."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def _rollout_only(cfg):
    """The run and a rollout-only engine set (validation needs no trainer)."""
    from gpu_jobs.stages import Roles, Run

    run = Run.open(cfg)
    return run, Roles.load(run, trainer=False)


@pytest.mark.slow
def test_validate_samples_n_per_prompt_and_reports_verl_metrics(tiny_config):
    from gpu_jobs import stages
    from gpu_jobs.stages.run import sampling_seed
    from gpu_jobs.stages.scoring import evaluate
    from storage import read_manifest, read_table

    cfg = tiny_config("rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=true",
                      "rollout.val_kwargs.temperature=1.0")
    run, eng = _rollout_only(cfg)
    uri = stages.validate(run, eng, 0)
    manifest = read_manifest(uri, run.storage)
    m, n_prompts = manifest.metrics, len(run.val)
    assert manifest.num_rows == 4 * n_prompts and m["val/n"] == 4 * n_prompts
    core = "val-core/rlmill/arith/reward"
    for name in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std"):
        assert f"{core}/{name}" in m, name
    for name in ("std@4", "best@2/mean", "worst@4/mean", "maj@2/mean"):
        assert f"val-aux/rlmill/arith/reward/{name}" in m, name
    # Every prompt has 4 responses: val/acc (mean of all scores) is mean@4 (mean of prompt means).
    assert m["val/acc"] == pytest.approx(m[f"{core}/mean@4"], abs=1e-9)
    # Best of 4 draws is at least their mean, which is at least the worst (0/1 scores).
    worst = m["val-aux/rlmill/arith/reward/worst@4/mean"]
    assert m[f"{core}/best@4/mean"] >= m[f"{core}/mean@4"] - 1e-9 >= worst - 2e-9
    assert 0.0 <= m[f"{core}/maj@4/mean"] <= 1.0 and m[f"{core}/best@4/std"] >= 0.0

    # Sampling is seeded per iteration: evaluating again draws the same responses and metrics.
    table = read_table(uri, storage=run.storage)
    prompts, ids = run.prompts(run.val, list(range(n_prompts)), None)
    again, m2 = evaluate(eng.rollout, run.tokenizer, prompts, ids, cfg.reward, cfg.rollout.max_response_length,
                         cfg.rollout.val_kwargs, seed=sampling_seed(cfg.data.seed + 1, 0), iteration=0, tag="val")
    assert again.column("response_ids").to_pylist() == table.column("response_ids").to_pylist()
    assert {k: v for k, v in m2.items()} == {k: v for k, v in m.items() if k in m2}
    # maj@n votes on the arith reward's prediction: the stripped response text.
    assert table.column("pred").to_pylist() == [t.strip() for t in table.column("response_text").to_pylist()]


@pytest.mark.slow
def test_default_validation_is_one_greedy_response_with_mean_at_1(tiny_config):
    from gpu_jobs import stages
    from gpu_jobs.stages.scoring import greedy_evaluate
    from storage import read_manifest

    cfg = tiny_config()
    run, eng = _rollout_only(cfg)
    m = read_manifest(stages.validate(run, eng, 0), run.storage).metrics
    assert m["val/n"] == len(run.val)
    assert m["val/acc"] == pytest.approx(m["val-core/rlmill/arith/reward/mean@1"], abs=1e-9)
    assert not any("best@" in k or "maj@" in k for k in m)
    # The nightly flow's and ReMax's greedy evaluator gives the same score.
    prompts, ids = run.prompts(run.val, list(range(len(run.val))), None)
    _, greedy = greedy_evaluate(eng.rollout, run.tokenizer, prompts, ids, cfg.reward, cfg.rollout.max_response_length)
    assert greedy["val/acc"] == pytest.approx(m["val/acc"], abs=1e-9)


def test_val_kwargs_errors_name_the_fix(tiny_config):
    from flows.config import ConfigError

    with pytest.raises(ConfigError, match="do_sample=true"):
        tiny_config("rollout.val_kwargs.n=4")
    with pytest.raises(ConfigError, match="temperature > 0"):
        tiny_config("rollout.val_kwargs.do_sample=true")


def test_summary_table_shows_core_metrics_with_their_bootstrap_std():
    from flows.reporting import validation_markdown

    core = "val-core/rlmill/arith/reward"
    md = validation_markdown({f"{core}/mean@4": 0.5, f"{core}/best@4/mean": 0.75, f"{core}/best@4/std": 0.125,
                              f"{core}/maj@4/mean": 0.5, f"{core}/maj@4/std": 0.25,
                              "val-aux/rlmill/arith/reward/std@4": 0.3, "val/acc": 0.5})
    lines = md.splitlines()
    assert lines[0] == "| data source | variable | mean@4 | best@4 | maj@4 |"
    assert lines[2] == "| rlmill/arith | reward | 0.5 | 0.75 ± 0.125 | 0.5 ± 0.25 |"
    assert validation_markdown({"val/acc": 1.0}) == ""
