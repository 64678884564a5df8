"""A verl command line unchanged (issue 44, item 6): hydra's `+key=value`, `++key=value` and
`~key[=value]` overrides, and YAML files written with verl's section names.

    .venv/bin/python -m pytest -q tests/flows/test_hydra_overrides.py

Config validation only: nothing here trains.
"""

from __future__ import annotations

import math
import shlex

import pytest
import yaml

from flows.config import ConfigError, frozen_config, load_run_config
from flows.overrides import Override, OverrideError, apply_overrides, config_names_run_id, parse_override

# The shape of verl's examples/grpo_trainer/run_qwen2-7b.sh (volcengine/verl) as verl users write it
# with hydra's forms (`+trainer.val_before_train=False`: a key older verl configs lacked) and a
# shell's quoting, `$@` included. Only the model and data paths differ from what they would run.
VERL_GRPO_SCRIPT = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$TRAIN \
    data.val_files=$TEST \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=builtin \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    reward_model.reward_manager="naive" \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    +trainer.val_before_train=False \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    ++trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""


def verl_command_line(train: str, test: str, extra: str = "") -> list[str]:
    """The script's arguments after `python3 -m verl.trainer.main_ppo`, as the shell passes them."""
    text = VERL_GRPO_SCRIPT.replace("$TRAIN", train).replace("$TEST", test).replace("$@", extra)
    argv = shlex.split(text.replace("\\\n", " "))
    assert argv[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    return argv[3:]


@pytest.fixture(scope="module")
def gsm_files(tmp_path_factory):
    """`rlmill data make gsm_symbolic`: 1100 rows, so that verl's batch of 1024 makes one step per epoch."""
    from gpu_jobs.data import make_dataset

    return make_dataset("gsm_symbolic", str(tmp_path_factory.mktemp("gsm")), train_size=1100, test_size=8, seed=0)


@pytest.fixture
def eight_gpus(monkeypatch):
    """tensor_model_parallel_size=2 is refused where no CUDA device is visible: the script is
    validated as on the 8-GPU machine it names (config validation only, nothing is built)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# ------------------------------------------------------------------------------ the grammar
@pytest.mark.parametrize("text, op, path, value", [
    ("rollout.n=8", "set", ("rollout", "n"), 8),
    ("+trainer.val_before_train=False", "add", ("trainer", "val_before_train"), False),
    ("++actor.lr=1e-6", "force", ("actor", "lr"), 1e-6),
    ("~rollout.n=8", "delete", ("rollout", "n"), 8),
])
def test_hydra_forms_parse(text, op, path, value):
    parsed = parse_override(text)
    assert (parsed.op, parsed.path, parsed.value) == (op, path, value) and parsed.has_value
    assert parse_override("~critic") == Override("delete", ("critic",))
    assert not parse_override("~critic").has_value


@pytest.mark.parametrize("bad", ["+rollout.n", "++rollout.n", "~", "+", "~rollout..n", "rollout.n"])
def test_malformed_hydra_forms_are_refused(bad):
    with pytest.raises(OverrideError, match="hydra's forms"):
        parse_override(bad)


def test_delete_on_a_plain_dict():
    out = apply_overrides({"rollout": {"n": 4, "top_k": 5}}, ["~rollout.n", "~rollout.top_k=5", "~missing"])
    assert out == {"rollout": {}}
    with pytest.raises(OverrideError, match=r"~rollout.n=3: rollout.n is 4, so it is not deleted"):
        apply_overrides({"rollout": {"n": 4}}, ["~rollout.n=3"])


# ------------------------------------------------------------------------------ meaning in rlmill
def test_plus_and_plus_plus_set_a_known_key():
    cfg = load_run_config(None, ["+trainer.val_before_train=False", "++rollout.n=3",
                                 "+actor_rollout_ref.actor.optim.lr=2e-6",
                                 "++actor_rollout_ref.rollout.temperature=0.7"])
    assert cfg.trainer.val_before_train is False and cfg.rollout.n == 3
    assert math.isclose(cfg.actor.lr, 2e-6) and cfg.rollout.temperature == 0.7


def test_tilde_resets_to_the_default(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout: {n: 4, top_k: 5}\nactor_rollout_ref: {actor: {optim: {lr: 3.0e-6}}}\n"
                    "critic: {lr: 1.0e-5}\n")
    defaults = load_run_config(None, [])
    assert load_run_config(path, []).rollout.n == 4
    cfg = load_run_config(path, ["~rollout.n", "~rollout.top_k=5", "~actor_rollout_ref.actor.optim.lr", "~critic"])
    assert cfg.rollout.n == defaults.rollout.n and cfg.rollout.top_k == defaults.rollout.top_k
    assert cfg.actor.lr == defaults.actor.lr and cfg.critic is None
    # ~key=value of a key nothing set compares with its default; a later override sets it again.
    assert load_run_config(None, [f"~rollout.n={defaults.rollout.n}", "rollout.n=6"]).rollout.n == 6
    assert load_run_config(None, ["~algorithm.adv_estimator=grpo"]).algorithm.adv_estimator == "grpo"
    # A verl key's value is translated before the comparison (True -> data.overlong_prompts=filter).
    assert load_run_config(None, ["data.filter_overlong_prompts=True", "~data.filter_overlong_prompts=True"]
                           ).data.overlong_prompts == defaults.data.overlong_prompts


@pytest.mark.parametrize("overrides, line", [
    (["rollout.n=4", "~rollout.n=3"], "~rollout.n=3: rollout.n is 4, so it is not deleted"),
    (["~critic.lr=1e-5"], "~critic.lr=1e-05: critic.lr is not set, so it is not deleted"),
    (["~rollout.nn"], "  rollout.nn: unknown key (did you mean rollout.n?"),
    (["+trainer.nope=1"], "  trainer.nope: unknown key"),
    (["+actor_rollout_ref.rollout.nope=1"], "  actor_rollout_ref.rollout.nope: verl key rlmill does not support"),
    (["~actor_rollout_ref.rollout.nope"], "  ~actor_rollout_ref.rollout.nope: verl key rlmill does not support"),
    (["~trainer.default_local_dir"], "  ~trainer.default_local_dir: verl key rlmill does not support"),
    (["++actor_rollout_ref.actor.strategy=megatron"], "strategy='megatron': megatron is not supported"),
    (["actor_rollout_ref.rollout.n=${data.n}"], "hydra interpolation (${...}) is not supported"),
])
def test_refusals_name_the_key_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, overrides)
    lines = str(err.value).splitlines()
    assert sum(line in shown for shown in lines) == 1, (line, lines)
    assert len(lines) <= 2  # the one line, under a heading when the message has one


def test_run_ids_follow_the_hydra_forms():
    assert config_names_run_id(None, ["+trainer.experiment_name=exp"])
    assert config_names_run_id(None, ["++run_id=r"])
    assert not config_names_run_id(None, ["run_id=r", "~run_id"])


# ------------------------------------------------------------------------------ the verl script
def _expect_the_script(cfg, train: str, test: str) -> None:
    assert cfg.run_id == "qwen2_7b_function_rm" and cfg.trainer.val_before_train is False
    assert cfg.data.train_files == [train] and cfg.data.val_files == [test]
    assert cfg.data.train_batch_size == 1024 and cfg.data.max_prompt_length == 512
    assert cfg.data.overlong_prompts == "filter" and cfg.rollout.max_response_length == 1024
    assert cfg.model.path == "builtin" and cfg.rollout.engine == "vllm" and cfg.rollout.n == 5
    assert cfg.rollout.engine_options.tensor_parallel_size == 2
    assert cfg.rollout.engine_options.gpu_memory_utilization == 0.6
    assert math.isclose(cfg.actor.lr, 1e-6) and cfg.actor.use_remove_padding and cfg.actor.gradient_checkpointing
    assert cfg.actor.ppo_mini_batch_size == 256 and cfg.actor.ppo_micro_batch_size_per_gpu == 40
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 40 and cfg.actor.entropy_coeff == 0
    assert cfg.actor.kl_loss.use_kl_loss and cfg.actor.kl_loss.kl_loss_type == "low_var_kl"
    assert math.isclose(cfg.actor.kl_loss.kl_loss_coef, 0.001)
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward and cfg.critic is None
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.nnodes == 1
    assert cfg.trainer.checkpoint_every == 20 and cfg.trainer.val_every == 5
    assert cfg.trainer.loggers == [] and cfg.trainer.tensorboard is False
    assert cfg.trainer.total_iterations == 15  # 15 epochs x (1100 rows // 1024)


def test_the_verl_grpo_script_is_accepted_unchanged(gsm_files, eight_gpus):
    train, test = gsm_files
    _expect_the_script(load_run_config(None, verl_command_line(train, test)), train, test)


def test_rlmill_train_takes_the_script_arguments(gsm_files, eight_gpus, capsys):
    """`rlmill train <the script's arguments>`: the parser `train` shares with `config show`
    (flows/cli.py) passes hydra's forms through; `config show` prints what train would run."""
    from flows.cli import build_parser, main

    train, test = gsm_files
    argv = verl_command_line(train, test, extra="~actor_rollout_ref.rollout.top_k")
    args, extra = build_parser().parse_known_args(["train", *argv])
    assert args.overrides == argv and not extra
    main(["config", "show", *argv])
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run_id"] == "qwen2_7b_function_rm" and shown["trainer"]["val_before_train"] is False
    assert shown["trainer"]["total_iterations"] == 15 and "actor_rollout_ref" not in shown


def test_the_script_refuses_what_rlmill_does_not_do_one_line_each(gsm_files, eight_gpus):
    from flows.cli import main

    train, test = gsm_files
    extra = ("+actor_rollout_ref.actor.strategy=megatron ~trainer.default_local_dir "
             "+actor_rollout_ref.rollout.add_bo_think_token=False trainer.logger='[console,swanlab]'")
    with pytest.raises(SystemExit) as exit_:
        main(["config", "show", *verl_command_line(train, test, extra)])
    lines = str(exit_.value.code).splitlines()
    assert lines[0].startswith("rlmill: verl keys rlmill does not support") and len(lines) == 5, lines
    for key in ("actor_rollout_ref.actor.strategy='megatron'", "~trainer.default_local_dir:",
                "actor_rollout_ref.rollout.add_bo_think_token:", "trainer.logger=['console', 'swanlab']"):
        assert sum(line.startswith(f"  {key}") for line in lines) == 1, (key, lines)


# ------------------------------------------------------------------------------ verl-style YAML
def _nested(argv: list[str]) -> dict:
    """The command line as a YAML file with verl's section names (keys untranslated)."""
    plain = [text.lstrip("+") for text in argv]
    return apply_overrides({}, plain)


def test_a_yaml_file_with_verl_section_names_means_the_command_line(gsm_files, eight_gpus, tmp_path):
    train, test = gsm_files
    argv = verl_command_line(train, test)
    path = tmp_path / "verl_grpo.yaml"
    path.write_text(yaml.safe_dump(_nested(argv)))
    sections = set(yaml.safe_load(path.read_text()))
    assert {"actor_rollout_ref", "algorithm", "data", "trainer", "reward_model"} <= sections
    from_file = load_run_config(path, [])
    _expect_the_script(from_file, train, test)
    assert frozen_config(from_file) == frozen_config(load_run_config(None, argv))
    assert config_names_run_id(str(path), [])  # trainer.experiment_name in the file names the run
    # The command line goes on top of the file, as hydra's overrides go on top of a config.
    on_top = load_run_config(path, ["actor_rollout_ref.rollout.n=3", "~trainer.val_before_train"])
    assert on_top.rollout.n == 3 and on_top.trainer.val_before_train is True


def test_a_verl_yaml_file_refuses_keys_rlmill_does_not_have(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor: {strategy: megatron, optim: {lr: 1.0e-6}}\n"
                    "  rollout: {n: 4, nope: 1}\n"
                    "data: {max_response_length: 16}\nrollout: {max_response_length: 8}\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path, [])
    lines = str(err.value).splitlines()
    assert any("actor_rollout_ref.actor.strategy='megatron'" in line for line in lines)
    assert any(line.startswith("  actor_rollout_ref.rollout.nope:") for line in lines) and len(lines) == 3
    path.write_text("data: {max_response_length: 16}\nrollout: {max_response_length: 8}\n")
    with pytest.raises(ConfigError, match="rollout.max_response_length is given different values"):
        load_run_config(path, [])


def test_hydra_forms_of_credentials_never_reach_the_config(monkeypatch):
    """`+storage.key=...` is a credential like `storage.key=...`: it goes to the AWS_* variables,
    never into the overrides a flow stores as its parameters; `~storage.key` is a reset and stays."""
    from flows.cli import _plain_overrides, _secrets_to_env

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    kept = _secrets_to_env(["+storage.key=AKIAEXAMPLE", "++storage.secret=s3cr3t", "~storage.token", "rollout.n=2"])
    import os

    assert kept == ["~storage.token", "rollout.n=2"]
    assert os.environ["AWS_ACCESS_KEY_ID"] == "AKIAEXAMPLE" and os.environ["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"
    assert _plain_overrides(["+storage.key=x", "++run_id=r", "rollout.n=2"]) == ["rollout.n=2"]
