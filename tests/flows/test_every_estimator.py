"""Every advantage estimator and policy loss trains through the stages (issue 16, item 6).

Each case is a tiny run on the built-in model (8 prompts x 4 samples, tests/tiny.py) driven by the
stage functions (DirectCalls, no Prefect) for 2 iterations. Checks: the update moved the policy's
weights, every numeric metric of both iterations is finite, and the metric that shows the variant
did its own work is there (clip_cov's clipped share, the adaptive KL coefficient moving, ...).
Each case starts from the example config a user runs for its family (EXAMPLE_OF), shrunk to the
tiny sizes; `test_every_example_loads` loads every examples/*.yaml as it ships.

    .venv/bin/python -m pytest -q tests/flows/test_every_estimator.py
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
from storage import read_manifest
from tests.tiny import REPO, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


def _positive(name: str):
    return lambda per_iter: per_iter[-1][name] > 0, f"{name} > 0"


def _kl_coef_moves(per_iter):
    # The adaptive controller steps after each iteration's KL: iteration 2 runs with a new coef.
    a, b = (m["actor/reward_kl_penalty_coeff"] for m in per_iter)
    return not math.isclose(a, b, rel_tol=1e-9)


# name -> (overrides, metrics that must be present, (check on [metrics of iteration 1, 2], what it checks))
CASES = {
    "reinforce_plus_plus": (["algorithm.adv_estimator=reinforce_plus_plus"], ["critic/advantages/mean"], None),
    "reinforce_plus_plus_baseline": (["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
                                     ["critic/advantages/mean"], None),
    "opo": (["algorithm.adv_estimator=opo"], ["critic/advantages/mean"], None),
    "gpg": (["algorithm.adv_estimator=gpg", "actor.policy_loss.loss_mode=gpg"], ["actor/pg_loss"], None),
    "grpo_passk": (["algorithm.adv_estimator=grpo_passk"], ["critic/advantages/mean"], None),
    # GSPO's sequence-level ratio; the paper's tiny clip range (3e-4, 4e-4) and seq-mean-token-mean.
    "gspo": (["actor.policy_loss.loss_mode=gspo", "actor.policy_loss.clip_ratio_low=0.0003",
              "actor.policy_loss.clip_ratio_high=0.0004", "actor.policy_loss.loss_agg_mode=seq-mean-token-mean",
              "actor.ppo_mini_batch_size=4", "actor.recompute_old_logprobs=true"],
             ["actor/pg_clipfrac", "actor/ppo_kl"], None),
    "cispo": (["actor.policy_loss.loss_mode=cispo", "actor.policy_loss.clip_ratio_high=0.28"],
              ["actor/pg_clipfrac"], None),
    # A wide covariance window and a large share, so that tokens are surely picked on a tiny batch.
    "clip_cov": (["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.2",
                  "actor.policy_loss.clip_cov_lb=-100", "actor.policy_loss.clip_cov_ub=100"],
                 ["actor/pg_clipfrac"], _positive("actor/pg_clipfrac")),
    # Two mini-batches: the second sees a moved policy, so |log r| (actor/ppo_kl) is > 0.
    "kl_cov": (["actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.2",
                "actor.ppo_mini_batch_size=4", "actor.recompute_old_logprobs=true"],
               ["actor/ppo_kl"], _positive("actor/ppo_kl")),
    "kl_in_reward_adaptive": (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                               "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.01",
                               "algorithm.kl_ctrl.horizon=64"],
                              ["actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"],
                              (_kl_coef_moves, "the adaptive KL coefficient changes between iterations")),
}

# The example config a user runs for each family (docs/guide/configs.md's table names the overrides).
EXAMPLE_OF = {
    "reinforce_plus_plus": "reinforce_pp_arith.yaml", "reinforce_plus_plus_baseline": "reinforce_pp_arith.yaml",
    "opo": "reinforce_pp_arith.yaml", "gpg": "gpg_arith.yaml", "grpo_passk": "reinforce_pp_arith.yaml",
    "gspo": "gspo_arith.yaml", "cispo": "gspo_arith.yaml", "clip_cov": "clip_cov_arith.yaml",
    "kl_cov": "clip_cov_arith.yaml", "kl_in_reward_adaptive": "kl_in_reward_arith.yaml",
}


def _finite_numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.parametrize("case", list(CASES))
def test_variant_trains_two_iterations(case, tmp_path):
    torch.set_num_threads(1)
    from flows.config import load_run_config

    overrides, required, check = CASES[case]
    cfg = load_run_config(REPO / "examples" / EXAMPLE_OF[case],
                          tiny_overrides(str(tmp_path / "root"), "trainer.total_iterations=2",
                                         "trainer.checkpoint_every=2", "data.val_size=8", *overrides))
    run, roles = open_warm(cfg)
    start = {k: v.clone() for k, v in roles.trainer.gathered_state_dict().items()}
    per_iter = []
    for k in (1, 2):
        uris = run_iteration(DirectCalls(run, roles), cfg, k)
        per_iter.append(read_manifest(uris["commit"], run.storage).metrics)
    end = roles.trainer.gathered_state_dict()
    roles.close()

    moved = max(float((end[name] - start[name]).abs().max()) for name in start)
    assert moved > 0, f"{case}: two updates left every weight unchanged"
    for k, metrics in enumerate(per_iter, start=1):
        numbers = _finite_numbers(metrics)
        bad = {m: v for m, v in numbers.items() if not math.isfinite(v)}
        assert not bad, f"{case}, iteration {k}: non-finite metrics {bad}"
        missing = [m for m in ("actor/pg_loss", *required) if m not in numbers]
        assert not missing, f"{case}, iteration {k}: metrics {missing} missing"
    if check is not None:
        fn, what = check
        assert fn(per_iter), f"{case}: expected {what}; got {[{m: x.get(m) for m in required} for x in per_iter]}"


def test_every_example_loads():
    """Every shipped example validates, and so does each variant docs/guide/configs.md's table names by override."""
    from flows.config import load_run_config

    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert {EXAMPLE_OF[c] for c in CASES} <= {p.name for p in examples}
    for path in examples:
        load_run_config(path)
    for case, (overrides, _, _) in CASES.items():
        cfg = load_run_config(REPO / "examples" / EXAMPLE_OF[case], overrides)
        assert any(case.startswith(v) for v in (cfg.algorithm.adv_estimator, cfg.actor.policy_loss.loss_mode,
                                                "kl_in_reward")), case
