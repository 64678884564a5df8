"""One GRPO step, same numbers as TRL (issue 45 item 1).

    .venv/bin/python -m pytest -q tests/algos/test_trl_parity.py

One fixed batch (3 prompts x G=4 responses of 1..7 tokens, left-padded prompts of different
lengths, rewards with one zero-std group, fixed old and reference log-probs) goes through

* TRL 1.16's own code on a real ``GRPOTrainer``: ``_generate_and_score_completions`` (its
  tokenisation, padding, reward call and advantages; generation replaced by a ``rollout_func``
  that returns the fixed responses), then ``compute_loss`` and ``backward``;
* rlmill's run path: ``gpu_jobs.algos.compute_advantage`` on the token-level scores the advantage
  stage builds, then ``PolicyTrainer.update`` (DeepSpeed ZeRO-0, packed micro-batches of 4 rows),
  its gradient read just before the optimizer step (the ``probe`` hook runs there).

Per TRL ``loss_type`` the rlmill settings that make the two equal (relative difference <= 1e-5,
fp32): the loss value, every parameter's gradient, and on the way the advantages and the
per-token log-probs at the sampling temperature. The settings both sides share: temperature 0.7,
clip 0.2 / 0.28, KL to the reference with beta 0.04 (k3, in the loss), one optimizer step on the
whole batch. TRL settings that have no rlmill equivalent are left at values that switch them off
(bf16=False, use_bias_correction_kl=False); the report of issue 45 lists them.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

pytestmark = pytest.mark.deepspeed

G, MAX_LEN = 4, 7
PROMPTS = ["12+34=", "7+8=", "99+1="]  # 6, 4, 5 characters: TRL and rlmill left-pad them
LENGTHS = [7, 3, 5, 2, 6, 6, 1, 4, 7, 2, 3, 5]  # one response of MAX_LEN: dr_grpo's normaliser
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 0.3, 0.9]  # group 2: zero std
TEMPERATURE, CLIP_LOW, CLIP_HIGH, BETA, DUAL_CLIP = 0.7, 0.2, 0.28, 0.04, 3.0
TRL_STD_EPSILON = 1e-4  # TRL: (r - mean) / (std + 1e-4), hard-coded; rlmill: algorithm.epsilon
RTOL = 1e-5

# TRL GRPOConfig -> rlmill settings that give the same step. "vanilla" is the PPO clip: TRL's
# `delta` (a cap on the ratio) equals rlmill's dual-clip clip_ratio_c for the negative advantages
# it bounds (for positive ones the upper clip already binds), so delta=3.0 <-> clip_ratio_c=3.0.
CASES = {
    # TRL kwargs, rlmill policy_loss kwargs, rlmill norm_adv_by_std_in_grpo
    "grpo": ({"loss_type": "grpo", "delta": DUAL_CLIP},
             {"loss_mode": "vanilla", "loss_agg_mode": "seq-mean-token-mean"}, True),
    "bnpo": ({"loss_type": "bnpo", "delta": DUAL_CLIP},
             {"loss_mode": "vanilla", "loss_agg_mode": "token-mean"}, True),
    "dapo": ({"loss_type": "dapo", "delta": DUAL_CLIP},
             {"loss_mode": "vanilla", "loss_agg_mode": "token-mean"}, True),
    # TRL's default: no cap on the ratio <-> a dual-clip bound no ratio reaches.
    "dapo-no-delta": ({"loss_type": "dapo"},
                      {"loss_mode": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio_c": 1e9}, True),
    # Dr. GRPO as its paper runs it: no std scaling either.
    "dr_grpo": ({"loss_type": "dr_grpo", "delta": DUAL_CLIP, "scale_rewards": "none"},
                {"loss_mode": "vanilla", "loss_agg_mode": "seq-mean-token-sum-norm"}, False),
    # GSPO: TRL's sequence-level ratio with loss_type grpo <-> rlmill's GSPO-token, which has the
    # same value and, with one advantage per response, the same gradient (arXiv:2507.18071).
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"},
             {"loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-mean"}, True),
    # LUSPO: the sequence ratio summed over the response's tokens, mean over responses.
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"},
              {"loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-sum"}, True),
    # CISPO: TRL clamps the detached ratio at epsilon_high (no lower bound); rlmill's cispo clamps
    # to [1 - clip_ratio_low, 1 + clip_ratio_high] with clip_ratio_low < 1, so the lower bound is
    # set as close to 0 as it goes (1e-6; no ratio of this batch comes near it).
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1 + CLIP_HIGH},
              {"loss_mode": "cispo", "loss_agg_mode": "token-mean", "clip_ratio_low": 1 - 1e-6}, True),
}


# ------------------------------------------------------------------------------ the fixed batch
@pytest.fixture(scope="module")
def trl_classes():
    """(GRPOConfig, GRPOTrainer), or skip when TRL is not installed.

    With vLLM installed, trl imports it, eagerly and again lazily inside GRPOTrainer (~11 s on 2
    busy cores), although nothing here generates. So vLLM is hidden from trl while this module
    uses it, and afterwards the trl modules imported that way are dropped from sys.modules: a
    later `import trl` in this process gets the real, vLLM-aware ones."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed: the bench extra has it (bash scripts/ensure_venv.sh test bench)")
    hide = "trl" not in sys.modules and "vllm" not in sys.modules
    if hide:
        import accelerate  # noqa: F401  (imported with vLLM visible: only trl's own modules see it hidden)
        import datasets  # noqa: F401

        sys.modules["vllm"] = None  # find_spec("vllm") is None: TRL decides vLLM is not installed
    try:
        from trl import GRPOConfig, GRPOTrainer

        yield GRPOConfig, GRPOTrainer
    finally:
        if hide:
            del sys.modules["vllm"]
            for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
                del sys.modules[name]


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The tiny model (a random 2-layer Qwen2 over the built-in character tokenizer), the token ids
    of prompts and responses, and the fixed old / reference log-probs ``(rows, MAX_LEN)``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gpu_jobs.models import build_tokenizer

    tok = build_tokenizer()
    path = str(tmp_path_factory.mktemp("trl_parity") / "model")
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=len(tok), max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    rng = np.random.default_rng(0)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS for _ in range(G)]
    responses = [rng.integers(4, len(tok), n).tolist() for n in LENGTHS]  # no special tokens
    # Old log-probs 0.5 nats around the current ones: ratios beyond both clip bounds and past the
    # dual-clip bound 3; the reference 0.2 nats around them: a KL with a gradient.
    current = _current_logprobs(path, prompt_ids, responses)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(MAX_LEN)[None] < torch.tensor(LENGTHS)[:, None]
    old = torch.where(mask, current + 0.5 * torch.randn(current.shape, generator=g), 0.0)
    ref = torch.where(mask, current + 0.2 * torch.randn(current.shape, generator=g), 0.0)
    return {"path": path, "tok": tok, "prompt_ids": prompt_ids, "responses": responses, "old": old, "ref": ref,
            "mask": mask, "current": current}


def _current_logprobs(path, prompt_ids, responses) -> torch.Tensor:
    """Log-probs at TEMPERATURE of each response under the start weights, one row at a time (no
    padding at all): the reference both sides' log-probs are checked against. ``(rows, MAX_LEN)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = torch.zeros(len(responses), MAX_LEN)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompt_ids, responses)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1] / TEMPERATURE
            out[i, : len(r)] = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(r)[:, None])[:, 0].float()
    return out


# ------------------------------------------------------------------------------ TRL's side
def trl_step(b, trl_classes, trl_kwargs: dict, tmp_path) -> dict:
    """TRL's advantages, log-probs, loss and gradients for the batch (its code end to end, but
    generation)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    GRPOConfig, GRPOTrainer = trl_classes
    tok = b["tok"]

    def rollout(prompts, trainer):  # TRL's rollout_func hook: the fixed responses instead of sampling
        return {"prompt_ids": [tok(p)["input_ids"] for p in prompts], "completion_ids": b["responses"],
                "logprobs": None}

    def reward(completions, reward, **kwargs):  # the dataset's `reward` column, as TRL passes columns
        return list(reward)

    args = GRPOConfig(**{
        "output_dir": str(tmp_path / "trl"), "use_cpu": True, "report_to": [], "logging_strategy": "no",
        "save_strategy": "no", "disable_tqdm": True,
        "bf16": False,  # TRL's default is bf16 autocast; rlmill's update runs in fp32
        "per_device_train_batch_size": len(LENGTHS), "gradient_accumulation_steps": 1, "num_generations": G,
        "max_completion_length": MAX_LEN, "temperature": TEMPERATURE, "epsilon": CLIP_LOW,
        "epsilon_high": CLIP_HIGH, "beta": BETA, "scale_rewards": "group",
        "use_bias_correction_kl": False,  # True (TRL's default) weighs the KL by the ratio, with its gradient
        **trl_kwargs})
    model = AutoModelForCausalLM.from_pretrained(b["path"], dtype=torch.float32)
    threads = torch.get_num_threads()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok, rollout_func=rollout,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    # accelerate sets torch's threads to the physical cores once DeepSpeed has set up torch.distributed
    torch.set_num_threads(threads)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one step, no accumulation
    inputs = [{"prompt": p, "reward": r} for p, r in zip([p for p in PROMPTS for _ in range(G)], REWARDS)]
    batch = trainer._generate_and_score_completions(inputs)
    with torch.no_grad():
        logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), MAX_LEN)
    batch["old_per_token_logps"], batch["ref_per_token_logps"] = b["old"], b["ref"]
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"advantages": batch["advantages"], "logprobs": logprobs, "loss": loss.item(), "grads": grads}


# ------------------------------------------------------------------------------ rlmill's side
def rlmill_advantages(norm_adv_by_std_in_grpo: bool, epsilon: float) -> torch.Tensor:
    """The run's advantage stage (each response's reward on its last token, then the estimator with
    the config's keyword arguments) for ``algorithm.adv_estimator=grpo``; one advantage per
    response ``(rows,)``."""
    from types import SimpleNamespace

    import pyarrow as pa

    from gpu_jobs.algos import AlgorithmConfig, OverlongBufferConfig
    from gpu_jobs.stages.advantage_math import batch_advantages

    algorithm = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                                epsilon=epsilon)
    table = pa.table({"group_id": [f"g{i // G}" for i in range(len(LENGTHS))], "response_len": LENGTHS,
                      "score": pa.array(REWARDS, pa.float32()),
                      "response_ids": pa.array([[5] * n for n in LENGTHS], pa.list_(pa.int32()))})
    cfg = SimpleNamespace(algorithm=algorithm, overlong_buffer=OverlongBufferConfig())
    table, _ = batch_advantages(table, cfg, kl_ctrl=None)
    return torch.tensor([row[0] for row in table.column("advantages").to_pylist()])


def rlmill_step(b, policy_loss: dict, advantages: torch.Tensor) -> dict:
    """rlmill's log-probs, loss and gradients: one PolicyTrainer.update on the batch."""
    import pyarrow as pa

    from gpu_jobs.algos import KLConfig, PolicyLossConfig
    from gpu_jobs.train import ActorConfig, PolicyTrainer

    def per_token(x):
        return pa.array([row[:n].tolist() for row, n in zip(x, LENGTHS)], pa.list_(pa.float32()))

    old = per_token(b["old"])
    table = pa.table({
        "group_id": [f"g{i // G}" for i in range(len(LENGTHS))],
        "prompt_ids": pa.array(b["prompt_ids"], pa.list_(pa.int32())),
        "response_ids": pa.array(b["responses"], pa.list_(pa.int32())),
        "advantages": per_token(advantages[:, None].expand(-1, MAX_LEN)),
        "old_logprobs": old, "rollout_logprobs": old,  # the probe reads rollout_logprobs
        "ref_logprobs": per_token(b["ref"]),
    })
    config = ActorConfig(
        temperature=TEMPERATURE, recompute_old_logprobs=False, zero_stage=0, dtype="fp32", entropy_coeff=0.0,
        ppo_mini_batch_size=len(PROMPTS), ppo_epochs=1, ppo_micro_batch_size_per_gpu=G,  # 3 micro-batches
        policy_loss=PolicyLossConfig(**{"clip_ratio_low": CLIP_LOW, "clip_ratio_high": CLIP_HIGH,
                                        "clip_ratio_c": DUAL_CLIP, **policy_loss}),
        kl_loss=KLConfig(use_kl_loss=True, kl_loss_coef=BETA, kl_loss_type="low_var_kl"))
    trainer = PolicyTrainer(b["path"], config)
    logprobs = trainer.compute_log_probs(table)
    grads = {}

    def probe(rollout, trainer_logprobs, mask):  # runs after the backward passes, before the step
        grads.update({n: p.grad.detach().clone() for n, p in trainer.engine.module.named_parameters()})

    metrics = trainer.update(table, probe=probe)
    return {"logprobs": logprobs, "loss": metrics["actor/pg_loss"] + BETA * metrics["actor/kl_loss"],
            "grads": grads, "metrics": metrics}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


# ------------------------------------------------------------------------------ the comparisons
@pytest.mark.parametrize("case", list(CASES))
def test_one_step_same_loss_and_gradient(case, batch, trl_classes, tmp_path):
    trl_kwargs, policy_loss, norm_by_std = CASES[case]
    trl = trl_step(batch, trl_classes, trl_kwargs, tmp_path)
    adv = rlmill_advantages(norm_by_std, epsilon=TRL_STD_EPSILON)
    assert _rel(adv, trl["advantages"]) <= RTOL
    ours = rlmill_step(batch, policy_loss, adv)

    # Log-probs at the temperature: both equal the unpadded single-row forward (TRL gives left-
    # padded rows shifted positions, which RoPE does not see; rlmill restarts them at 0).
    mask = batch["mask"]
    assert (trl["logprobs"] - batch["current"])[mask].abs().max() <= 1e-5
    ours_lp = torch.zeros(len(LENGTHS), MAX_LEN)
    for i, row in enumerate(ours["logprobs"]):
        ours_lp[i, : len(row)] = torch.as_tensor(row)
    assert (ours_lp - batch["current"])[mask].abs().max() <= 1e-5

    assert abs(ours["loss"] - trl["loss"]) <= RTOL * abs(trl["loss"]), (ours["loss"], trl["loss"])
    assert ours["grads"].keys() == trl["grads"].keys()
    flat = [torch.cat([g[n].flatten() for n in sorted(g)]) for g in (ours["grads"], trl["grads"])]
    assert _rel(*flat) <= RTOL, _rel(*flat)
    worst = max(_rel(ours["grads"][n], trl["grads"][n]) for n in trl["grads"])
    assert worst <= RTOL, worst  # each parameter's gradient, too
    if policy_loss["loss_mode"] == "vanilla":  # the batch reaches both clip bounds (and the dual clip)
        assert ours["metrics"]["actor/pg_clipfrac"] > 0
        assert (ours["metrics"]["actor/pg_clipfrac_lower"] > 0) == ("delta" in trl_kwargs)


@pytest.mark.parametrize("scale_rewards, norm_by_std", [("group", True), ("none", False)])
def test_advantages_equal_trl_with_its_epsilon(scale_rewards, norm_by_std, batch, trl_classes, tmp_path):
    """scale_rewards "group" is grpo with std (unbiased, as TRL's nanstd), "none" is
    norm_adv_by_std_in_grpo=False; TRL adds 1e-4 to the std where rlmill's default
    algorithm.epsilon adds 1e-6: a relative difference of ~1e-4 / std (2e-4 here)."""
    trl = trl_step(batch, trl_classes, {"scale_rewards": scale_rewards}, tmp_path)
    assert _rel(rlmill_advantages(norm_by_std, epsilon=TRL_STD_EPSILON), trl["advantages"]) <= RTOL
    default = rlmill_advantages(norm_by_std, epsilon=1e-6)
    if norm_by_std:
        assert 1e-5 < _rel(default, trl["advantages"]) < 1e-3
    else:
        assert _rel(default, trl["advantages"]) <= RTOL
