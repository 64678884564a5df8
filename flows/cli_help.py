"""What `rlmill --help` and `rlmill <command> --help` show beyond each argument (flows.cli)."""

__all__ = ["MAIN_HELP", "TRAIN_HELP", "VERIFY_HELP", "CONFIG_SHOW_HELP", "RUN_HELP"]

# What `--help` shows beyond each argument: what a newcomer needs to run, resume and inspect a
# run, with examples. tests/test_readme_commands.py runs every example command here through
# the parser and checks every config key named against RunConfig.
MAIN_HELP = """\
examples:
  rlmill run                                                  # GRPO on the built-in task: accuracy before/after
  rlmill train --config examples/grpo_arith.yaml              # a new run; its id is printed first
  rlmill train --config examples/grpo_arith.yaml run_id=ID    # resume run ID where it stopped
  rlmill train --config examples/sft_arith.yaml               # supervised fine-tuning (an sft: section)
  rlmill config show --config examples/ppo_critic_arith.yaml  # every key of that run, with its value
  rlmill verify --config examples/grpo_arith.yaml run_id=ID   # check run ID's committed data
  rlmill data make gsm_symbolic --out data/gsm                # a verl-format train/test Parquet pair

Configs: examples/ holds one YAML file per algorithm (docs/guide/configs.md lists them; SFT, DPO
and KTO train on a dataset: sft_arith, dpo_feedback, kto_feedback); `rlmill config show [--config
FILE]` prints every key with its default.
More on each command: rlmill <command> --help.
"""

TRAIN_HELP = """\
The config: --config FILE (a YAML file, e.g. examples/grpo_arith.yaml), then the key=value
overrides in order (a later one wins). Without --config, rlmill's defaults: GRPO on the built-in
arithmetic task with the built-in model. `rlmill config show [--config FILE] [key=value ...]`
prints every key of the run with its value; verl's keys (actor_rollout_ref.rollout.n=5,
trainer.total_training_steps=20, ...) are translated.

Run ids and resuming: a run that neither the file nor the overrides name gets a fresh id,
<config file>-<YYYYmmdd-HHMMSS> (run-<...> without --config), printed first. run_id=ID resumes
run ID where it stopped: committed stages are not recomputed and the final weights equal those
of an uninterrupted run; the config must be the same (a changed one is refused). A run_id= that
does not exist yet starts a new run under that name. root= is where runs live (a folder or
s3://bucket/prefix; the run is <root>/runs/<run_id>; default .rlmill): resume with the same root.

Forking: --from RUN@K starts a new run from run RUN's checkpoint at iteration K (weights,
optimizer, data position, RNG) that goes on at iteration K+1 with this command's config; its
run.json records the parent and the changed keys (docs/guide/configs.md, "Fork a run").

examples:
  rlmill train --config examples/grpo_arith.yaml
  rlmill train --config examples/grpo_arith.yaml algorithm.adv_estimator=rloo rollout.n=8
  rlmill train --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000
  rlmill train --config examples/grpo_arith.yaml root=/tmp/rl trainer.total_iterations=5
  rlmill train --config examples/grpo_arith.yaml --from grpo-arith-20261201-093000@10 actor.lr=5e-5
"""

VERIFY_HELP = """\
Name the run with run_id=ID (the id `rlmill train` printed first) and give the config it was
started with (and its root=, if you set one); without run_id=, verify lists the runs under the
root. Every committed table is read back against its manifest (sizes, sha256), every trainer
checkpoint against its checksums. --repair sets damaged stages of the iteration in flight aside
(copied, then uncommitted), so the next `rlmill train ... run_id=ID` recomputes them; nothing is
deleted. Exit status 1 while damage that needs you remains.

examples:
  rlmill verify --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000
  rlmill verify --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000 --repair
"""

CONFIG_SHOW_HELP = """\
Every key of the run `rlmill train` would start with the same arguments, its value and every
default filled in (the first line, run_id, shows how the run will be named). Keys are what
--config files and key=value overrides set; verl's keys are translated.

examples:
  rlmill config show
  rlmill config show --config examples/ppo_critic_arith.yaml
  rlmill config show --config examples/grpo_arith.yaml actor_rollout_ref.rollout.n=5
"""

RUN_HELP = """\
examples/grpo_arith.yaml, built in (no examples/ folder needed): 20 GRPO iterations on the
built-in arithmetic task, then the held-out accuracy before and after. Each call is a new run
(its id printed first); --run-id ID resumes one. Runs go to ./.rlmill.

examples:
  rlmill run
  rlmill run --run-id grpo-arith-20261201-093000
  rlmill run trainer.total_iterations=5
"""
