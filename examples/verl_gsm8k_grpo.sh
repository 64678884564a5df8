#!/usr/bin/env bash
# verl's GSM8K GRPO example (examples/grpo_trainer/run_qwen2-7b.sh in volcengine/verl), run by
# rlmill: every key and value as verl publishes them except the model and data paths, then
# CPU-scale overrides (later keys win, as in verl/hydra): 4 prompts x 5 samples, 8-token responses,
# one trainer rank, no tensor parallelism, 1 iteration, console logging only.
#
#   bash examples/verl_gsm8k_grpo.sh                    # a new run each time (a minute or two on 2 cores)
#   RUN_ID=<id it printed> bash examples/verl_gsm8k_grpo.sh      # resume that run
#   bash examples/verl_gsm8k_grpo.sh trainer.total_training_steps=5   # more overrides: appended, last wins
#
# verl's trainer.experiment_name names the run (rlmill's run_id), and naming a run resumes it: the
# fixed name verl's script gives would make every run after the first resume the finished one and
# train nothing. So the last override names a new run per call (RUN_ID= to resume one).
# tests/flows/test_verl_command_line.py checks that these are exactly the keys it trains with;
# tests/test_examples.py runs the script twice in a row.
set -euo pipefail
RLMILL=${RLMILL:-.venv/bin/rlmill}
DATA=${DATA:-.rlmill/data/gsm_symbolic-32}            # this clone's, under rlmill's default root
RUN_ID=${RUN_ID:-verl-gsm8k-grpo-$(date +%Y%m%d-%H%M%S)}
"$RLMILL" data make gsm_symbolic --out "$DATA" --train-size 32 --test-size 8

"$RLMILL" train \
    `# verl's command line, paths changed` \
    algorithm.adv_estimator=grpo \
    "data.train_files=$DATA/train.parquet" \
    "data.val_files=$DATA/test.parquet" \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    'data.truncation='\''error'\''' \
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
    trainer.critic_warmup=0 \
    'trainer.logger=["console","wandb"]' \
    trainer.project_name=verl_grpo_example_gsm8k \
    trainer.experiment_name=qwen2_7b_function_rm \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 \
    `# CPU scale` \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    trainer.n_gpus_per_node=1 \
    'trainer.logger=["console"]' \
    data.train_batch_size=4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    data.max_response_length=8 \
    trainer.total_training_steps=1 \
    `# a new run per call (RUN_ID= resumes one), then the caller's overrides` \
    "trainer.experiment_name=$RUN_ID" \
    "$@"
