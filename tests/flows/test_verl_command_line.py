"""verl command lines (issue 16, item 5): flows/verl_keys.py translates verl's dotted keys.

The end-to-end test runs verl's published GSM8K GRPO example, examples/grpo_trainer/run_qwen2-7b.sh
(volcengine/verl), as `VERL_GSM8K` below: every key and value as published, except
- the paths: actor_rollout_ref.model.path=builtin (the built-in tiny model) and data.train_files /
  data.val_files = a GSM8K-style verl-format Parquet pair that `rlmill data make gsm_symbolic` writes;
then `CPU_SCALE`, trailing overrides (later overrides win, as in verl/hydra) that shrink the GPU
cluster's sizes to 2 busy CPU cores: 4 prompts (the 5 samples each stay), 8-token responses, one
trainer rank, no tensor parallelism, 1 iteration, and the console logger only (wandb is not installed).

    .venv/bin/python -m pytest -q tests/flows/test_verl_command_line.py
"""

from __future__ import annotations

import math
import pytest

from flows.config import ConfigError, load_run_config
from flows.overrides import config_names_run_id
from flows.verl_keys import VERL_KEYS


def verl_gsm8k(train: str, test: str) -> list[str]:
    """verl's run_qwen2-7b.sh (the GSM8K GRPO example), model and data paths changed."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        "actor_rollout_ref.model.path=builtin",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=[\"console\",\"wandb\"]",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]


CPU_SCALE = [
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[\"console\"]",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "data.max_response_length=8",
    "trainer.total_training_steps=1",
]


@pytest.fixture(scope="module")
def gsm_files(tmp_path_factory):
    """What `rlmill data make gsm_symbolic --train-size 32 --test-size 8` writes."""
    from gpu_jobs.data import make_dataset

    out = tmp_path_factory.mktemp("gsm")
    return make_dataset("gsm_symbolic", str(out), train_size=32, test_size=8, seed=0)


# ------------------------------------------------------------------------------ translation
def _rlmill_keys() -> set[str]:
    import typing

    from pydantic import BaseModel

    from gpu_jobs.stages.config import RunConfig

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            yield prefix + name
            for arg in (field.annotation, *typing.get_args(field.annotation)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    yield from walk(arg, f"{prefix}{name}.")
    return set(walk(RunConfig))


def test_every_translation_targets_an_rlmill_key():
    keys = _rlmill_keys()
    bad = {verl: rule.targets for verl, rule in VERL_KEYS.items() if not set(rule.targets) <= keys}
    assert not bad, f"verl keys translated to keys RunConfig does not have: {bad}"
    assert all(rule.doc for rule in VERL_KEYS.values())


def test_the_gsm8k_command_line_translates(gsm_files):
    train, test = gsm_files
    cfg = load_run_config(None, ["root=/tmp/unused", *verl_gsm8k(train, test), *CPU_SCALE])
    assert cfg.run_id == "qwen2_7b_function_rm"  # trainer.experiment_name
    assert cfg.data.train_files == [train] and cfg.data.val_files == [test]  # one file -> a list
    assert cfg.data.overlong_prompts == "filter" and cfg.data.max_prompt_length == 512
    assert cfg.model.path == "builtin" and cfg.rollout.engine == "vllm" and cfg.rollout.n == 5
    assert cfg.rollout.max_response_length == 8 and cfg.rollout.engine_options.gpu_memory_utilization == 0.6
    assert math.isclose(cfg.actor.lr, 1e-6) and cfg.actor.use_remove_padding and cfg.actor.gradient_checkpointing
    assert cfg.actor.ppo_mini_batch_size == 4 and cfg.actor.ppo_micro_batch_size_per_gpu == 40
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 40 and cfg.actor.entropy_coeff == 0
    assert cfg.actor.kl_loss.use_kl_loss and cfg.actor.kl_loss.kl_loss_type == "low_var_kl"
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward and cfg.critic is None
    assert cfg.trainer.checkpoint_every == 20 and cfg.trainer.val_every == 5
    assert cfg.trainer.loggers == [] and cfg.trainer.tensorboard is False  # verl's list names no tensorboard
    assert cfg.trainer.total_iterations == 1  # total_training_steps wins over total_epochs, as in verl
    # Without it, total_epochs=15 passes over the 32 rows in batches of 4: 15 x 8 iterations.
    assert load_run_config(None, [*verl_gsm8k(train, test), *CPU_SCALE[:-1]]).trainer.total_iterations == 120


@pytest.mark.parametrize("verl, expected", [
    (["trainer.save_freq=-1"], {"trainer.checkpoint_every": 10**9}),  # verl: never; rlmill: only the final one
    (["trainer.test_freq=-1"], {"trainer.val_every": 0}),
    (["trainer.logger=[console,tensorboard]"], {"trainer.tensorboard": True, "trainer.loggers": []}),
    (["actor_rollout_ref.actor.optim.lr_warmup_steps=-1"], {"actor.lr_warmup_steps": 0}),
    (["actor_rollout_ref.actor.optim.lr_warmup_steps=3", "actor_rollout_ref.actor.optim.warmup_style=cosine",
      "actor_rollout_ref.actor.optim.total_training_steps=10"],
     {"actor.lr_warmup_steps": 3, "actor.lr_scheduler": "cosine", "actor.total_training_steps": 10}),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_high=0.0004",
      "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
     {"actor.policy_loss.loss_mode": "gspo", "actor.policy_loss.clip_ratio_high": 0.0004,
      "actor.policy_loss.loss_agg_mode": "seq-mean-token-mean"}),
    (["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
      "reward_model.overlong_buffer.len=2", "reward_model.overlong_buffer.penalty_factor=1.0"],
     {"overlong_buffer.enable": True, "overlong_buffer.len": 2, "overlong_buffer.penalty_factor": 1.0}),
    (["data.val_max_samples=16", "data.seed=7", "data.filter_overlong_prompts=False"],
     {"data.val_size": 16, "data.seed": 7, "data.overlong_prompts": "error"}),
    (["trainer.critic_warmup=2", "algorithm.adv_estimator=gae"], {"critic.critic_warmup": 2}),
])
def test_verl_values_mean_the_same_in_rlmill(verl, expected):
    cfg = load_run_config(None, verl)
    for dotted, value in expected.items():
        node = cfg
        for part in dotted.split("."):
            node = getattr(node, part)
        assert node == (pytest.approx(value) if isinstance(value, float) else value), dotted


def test_custom_reward_function_keys(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = load_run_config(None, [f"custom_reward_function.path={reward}", "custom_reward_function.name=my_score"])
    assert cfg.reward.custom_reward_function.path == str(reward)
    assert cfg.reward.custom_reward_function.name == "my_score"


def test_unsupported_verl_keys_fail_together_naming_each():
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "data.truncation=left",
                               "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.rollout.nn=5",
                               "trainer.logger=[console,swanlab]", "rollout.n=4"])
    lines = str(err.value).splitlines()
    assert lines[0].startswith("verl keys rlmill does not support")
    for key in ("ulysses_sequence_parallel_size=2", "data.truncation='left'", "strategy='megatron'",
                "actor_rollout_ref.rollout.nn:", "swanlab"):
        assert sum(key in line for line in lines[1:]) == 1, (key, lines)
    assert len(lines) == 6


def test_a_verl_key_and_its_rlmill_key_must_agree():
    with pytest.raises(ConfigError, match=r"rollout.n is given different values: actor_rollout_ref.rollout.n=5, "
                                          r"rollout.n=3"):
        load_run_config(None, ["actor_rollout_ref.rollout.n=5", "rollout.n=3"])
    with pytest.raises(ConfigError, match="rollout.max_response_length is given different values"):
        load_run_config(None, ["data.max_response_length=16", "actor_rollout_ref.rollout.response_length=8"])
    # The same value twice is no conflict; the same key twice takes its last value (hydra).
    assert load_run_config(None, ["actor_rollout_ref.rollout.n=4", "rollout.n=4"]).rollout.n == 4
    assert load_run_config(None, ["actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.n=2"]).rollout.n == 2
    # A verl value that is not rlmill's own way of saying it is rejected, not ignored.
    with pytest.raises(ConfigError, match="rollout.temperature=0 samples greedily"):
        load_run_config(None, ["actor_rollout_ref.rollout.do_sample=False"])


def test_total_epochs_counts_batches_of_the_train_data(gsm_files):
    train, _ = gsm_files
    # verl's dataloader drops the last partial batch: 32 rows // 5 = 6 steps per epoch.
    assert load_run_config(None, [f"data.train_files={train}", "data.train_batch_size=5",
                                  "actor.ppo_mini_batch_size=5", "trainer.total_epochs=2"]).trainer.total_iterations == 12
    # Generated data: data.train_size rows. total_training_steps wins in either order.
    assert load_run_config(None, ["data.train_size=100", "data.train_batch_size=16",
                                  "trainer.total_epochs=3"]).trainer.total_iterations == 18
    assert load_run_config(None, ["trainer.total_training_steps=7", "trainer.total_epochs=3"]).trainer.total_iterations == 7
    with pytest.raises(ConfigError, match="cannot be read"):
        load_run_config(None, ["data.train_files=/nonexistent/train.parquet", "trainer.total_epochs=1"])


def test_experiment_name_names_the_run():
    assert config_names_run_id(None, ["trainer.experiment_name=exp1"])
    assert not config_names_run_id(None, ["trainer.project_name=p"])


def test_config_show_prints_the_translated_config(gsm_files, capsys):
    """`rlmill config show` reaches the translation through load_run_config (flows/cli.py unchanged)."""
    import yaml

    from flows.cli import main

    train, test = gsm_files
    main(["config", "show", *verl_gsm8k(train, test), *CPU_SCALE])
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run_id"] == "qwen2_7b_function_rm" and shown["rollout"]["engine"] == "vllm"
    assert shown["actor"]["kl_loss"]["use_kl_loss"] is True and "actor_rollout_ref" not in shown
    with pytest.raises(SystemExit) as exit_:
        main(["config", "show", "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert str(exit_.value.code).startswith("rlmill: verl keys rlmill does not support")
    assert "sglang" in str(exit_.value.code) and capsys.readouterr().out == ""


# ------------------------------------------------------------------------------ the run
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.deepspeed
def test_the_gsm8k_command_line_trains(gsm_files, tmp_path):
    """The published command (+ CPU_SCALE) through load_run_config and the stages: one GRPO
    iteration with vLLM rollout, the KL loss against the reference model, and a DeepSpeed update."""
    import torch

    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from storage import read_manifest

    torch.set_num_threads(1)
    train, test = gsm_files
    cfg = load_run_config(None, [f"root={tmp_path / 'root'}", *verl_gsm8k(train, test), *CPU_SCALE])
    run, roles = open_warm(cfg)
    try:
        uris = run_iteration(DirectCalls(run, roles), cfg, 1)
    finally:
        roles.close()
    metrics = read_manifest(uris["commit"], run.storage).metrics
    numbers = {k: v for k, v in metrics.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in numbers.values()), numbers
    assert "actor/kl_loss" in metrics and "actor/pg_loss" in metrics
    assert read_manifest(uris["advantages"], run.storage).num_rows == 4 * 5  # 4 prompts x rollout.n=5
    assert run.layout.run_id == "qwen2_7b_function_rm"


def test_the_example_script_is_this_command_line(tmp_path):
    """examples/verl_gsm8k_grpo.sh runs exactly the keys the tests above translate and train with
    (a stand-in `rlmill` prints the argv the script passes it)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    fake = tmp_path / "rlmill"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(["bash", str(repo / "examples" / "verl_gsm8k_grpo.sh")], cwd=repo, check=True,
                         capture_output=True, text=True, env={**os.environ, "RLMILL": str(fake), "DATA": "/d"})
    data_make, train = (json.loads(line) for line in out.stdout.splitlines())
    assert data_make[:4] == ["data", "make", "gsm_symbolic", "--out"]
    # ... then a new run per call (verl's fixed experiment_name would resume the finished run):
    assert train[:-1] == ["train", *verl_gsm8k("/d/train.parquet", "/d/test.parquet"), *CPU_SCALE]
    assert train[-1].startswith("trainer.experiment_name=verl-gsm8k-grpo-")


def test_rollout_parallelism_keys_reach_the_engine_options_and_tensor_parallel_needs_cuda():
    cfg = load_run_config(None, ["actor_rollout_ref.rollout.data_parallel_size=2"])
    assert cfg.rollout.engine_options.data_parallel_size == 2
    # Tensor parallelism splits one replica over GPUs: refused before any work on a CPU box
    # (colocated: this process would build the engine), named with its fix.
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        load_run_config(None, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                               "actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ConfigError, match="needs rollout.engine=vllm"):
        load_run_config(None, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
