"""rlmill's compute layer: models, rollout, rewards, RL math, training and the stages."""

from gpu_jobs.import_hooks import install_deepspeed_hook

# Before anything imports DeepSpeed (accelerate does, inside save_pretrained): 2 s less per
# training process (gpu_jobs/import_hooks.py says why).
install_deepspeed_hook()
