"""Model-based reward in runs: the built-in arithmetic reward model, the reward_model stage in
the iteration graph (own warm engine, own commit), and how its score combines with the rule's."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def rm_config(tmp_path):
    """rm_config(*overrides) -> a tiny run of examples/grpo_arith_reward_model.yaml under tmp_path
    (reward_model: builtin, combine: add, coef: 0.1)."""
    from flows.config import load_run_config
    from tests.tiny import REPO, tiny_overrides

    example = REPO / "examples" / "grpo_arith_reward_model.yaml"
    return lambda *extra: load_run_config(example, tiny_overrides(str(tmp_path / "root"), *extra))


def _split(text: str) -> tuple[str, str]:
    prompt, _, answer = text.partition("=")
    return prompt + "=", answer


@pytest.mark.slow
def test_builtin_reward_model_separates_right_from_wrong_answers():
    """On answers the built-in policy samples to problems drawn fresh (labelled by the rule),
    right ones outscore wrong ones more often than a coin would: AUC measured 0.554-0.561 on
    three such draws of 3600 answers (standard error ~0.01), so 0.53 leaves ~3 errors of margin.
    A weak judge (see gpu_jobs/models/reward_model.py), but a measured one. Scored through the
    run's scorer with chat messages, as the stage does."""
    from gpu_jobs.models import build_tokenizer, load_model
    from gpu_jobs.models.reward_model import auc, ensure_arith_reward_model, labelled_answers
    from gpu_jobs.models.tiny import probe_problems
    from gpu_jobs.reward import ModelRewardScorer

    scorer = ModelRewardScorer(ensure_arith_reward_model(), batch_size=256)
    policy, _ = load_model("builtin")
    data = labelled_answers(policy, build_tokenizer(), probe_problems(600, seed=77_005), samples=4, seed=5)
    pairs = [_split(text) for text, _ in data]
    scores = scorer.score([[{"role": "user", "content": p}] for p, _ in pairs], [a for _, a in pairs])
    labels = [y for _, y in data]
    assert 0.2 < sum(labels) / len(labels) < 0.8  # both classes well represented
    assert auc(scores, labels) > 0.53


def test_auc_by_hand():
    from gpu_jobs.models.reward_model import auc

    assert auc([3.0, 2.0, 1.0], [1, 1, 0]) == 1.0  # every right answer above the wrong one
    assert auc([1.0, 2.0], [1, 0]) == 0.0
    assert auc([1.0, 1.0, 0.0], [1, 0, 0]) == 0.75  # pairs (1 vs 1): tie = 1/2, (1 vs 0): 1
    assert auc([1.0], [1]) == 0.5


def test_combination_rule():
    from gpu_jobs.reward import RewardModelConfig

    assert RewardModelConfig(enable=True, coef=2.0).combined(1.0, 0.25) == 0.5  # rm_only: coef * rm
    assert RewardModelConfig(enable=True, combine="add", coef=0.5).combined(1.0, -2.0) == 0.0  # rule + coef * rm


def test_reward_model_config_errors_name_the_fix(rm_config):
    from gpu_jobs.stages.config import ConfigError, build_run_config

    with pytest.raises(ConfigError, match="filter_groups"):
        rm_config("algorithm.filter_groups.enable=true")
    with pytest.raises(ConfigError, match="adv_estimator=remax"):
        rm_config("algorithm.adv_estimator=remax")
    with pytest.raises(ConfigError, match="enable=false"):
        build_run_config({"reward_model": {"enable": True, "coef": 0}})
    with pytest.raises(ConfigError, match="did you mean reward_model.enable"):
        build_run_config({"reward_model": {"enabel": True}})


@pytest.mark.slow
@pytest.mark.deepspeed
def test_reward_model_stage_commits_scores_the_reward_stage_combines(rm_config):
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from storage import committed, read_manifest, read_table

    cfg = rm_config("trainer.total_iterations=2", "trainer.checkpoint_every=2")
    assert cfg.reward_model.combine == "add" and cfg.reward_model.coef == 0.1
    run, eng = open_warm(cfg, probe=False)
    uris = run_iteration(DirectCalls(run, eng), cfg, 1)
    assert uris["reward_model"] == committed(run.layout.stage(1, "reward_model"), run.storage)
    rm = read_table(uris["reward_model"], storage=run.storage)
    reward = read_table(uris["reward"], storage=run.storage)
    assert rm.num_rows == reward.num_rows == 32
    by_uid = dict(zip(rm.column("uid").to_pylist(), rm.column("rm_score").to_pylist()))
    for row in reward.to_pylist():
        assert row["rm_score"] == pytest.approx(by_uid[row["uid"]])
        assert row["score"] == pytest.approx(row["rule_score"] + 0.1 * row["rm_score"], abs=1e-5)
    assert uris["reward_model"] in read_manifest(uris["reward"], run.storage).inputs
    metrics = read_manifest(uris["commit"], run.storage).metrics
    for name in ("critic/rm_score/mean", "critic/rule_score/mean", "critic/score/mean", "timing_s/reward_model"):
        assert name in metrics, name
    assert metrics["critic/score/mean"] == pytest.approx(
        metrics["critic/rule_score/mean"] + 0.1 * metrics["critic/rm_score/mean"], abs=1e-5)
    # The scorer is the stage's warm engine: loaded once, kept for the next iteration.
    scorer = eng.reward_model
    assert scorer is not None
    run_iteration(DirectCalls(run, eng), cfg, 2)
    assert eng.reward_model is scorer


@pytest.fixture(scope="module")
def prefect_api():
    """A Prefect API of this module's own (~10-20 s to start); yields its URL."""
    from tests.servers import module_prefect_api

    with module_prefect_api() as url:
        yield url


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.deepspeed
def test_reward_model_and_val_at_n_through_the_prefect_flow(prefect_api, tmp_path):
    """The flow picks the reward_model task like any stage (PrefectCalls over each stage's task), and
    validation with val_kwargs reports val-core metrics in its committed manifest."""
    import asyncio

    from prefect.client.orchestration import get_client

    from flows.training import rl_training
    from storage import RunLayout, committed, read_manifest
    from tests.tiny import REPO, tiny_overrides

    root = str(tmp_path / "root")
    overrides = tiny_overrides(root, "run_id=rm-flow", "rollout.val_kwargs.n=2", "rollout.val_kwargs.do_sample=true",
                               "rollout.val_kwargs.temperature=1.0", "data.val_size=16")
    rl_training(config=str(REPO / "examples" / "grpo_arith_reward_model.yaml"), overrides=overrides, iterations=1)
    layout = RunLayout(root, "rm-flow")
    assert committed(layout.stage(1, "reward_model"))
    commit = read_manifest(committed(layout.stage(1, "commit"))).metrics
    assert "critic/rm_score/mean" in commit and "critic/rule_score/mean" in commit
    val = read_manifest(committed(layout.stage(1, "validate"))).metrics
    assert "val-core/rlmill/arith/reward/maj@2/mean" in val and val["val/n"] == 32

    async def task_run_names():
        async with get_client() as client:
            return {t.name for t in await client.read_task_runs(limit=200)}

    assert any(name.startswith("reward_model") for name in asyncio.run(task_run_names()))
