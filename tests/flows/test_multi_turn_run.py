"""Multi-turn rollouts with tools through the stages: examples/grpo_arith_tools.yaml on the
built-in tool model, tiny, stage functions called directly (no Prefect server).

    .venv/bin/python -m pytest -q tests/flows/test_multi_turn_run.py
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tests.tiny import REPO, tiny_overrides

EXAMPLE = REPO / "examples" / "grpo_arith_tools.yaml"


def test_trainer_batch_takes_response_mask_into_the_loss_mask():
    from gpu_jobs.train.batch import collate, read_rows
    from gpu_jobs.train.errors import TrainInputError

    table = pa.table({
        "prompt_ids": pa.array([[5, 6], [7]], pa.list_(pa.int32())),
        "response_ids": pa.array([[8, 9, 10, 11], [12, 13]], pa.list_(pa.int32())),
        "advantages": pa.array([[1.0] * 4, [2.0] * 2], pa.list_(pa.float32())),
        "response_mask": pa.array([[1, 0, 0, 1], [1, 1]], pa.list_(pa.int8())),
    })
    rows = read_rows(table, vocab_size=32)
    assert rows.response_tokens([0, 1]) == 4  # token-mean's denominator counts model tokens only
    for packed in (False, True):
        mb = collate(rows, [0, 1], packed=packed)
        assert mb["response_mask"].tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    single = read_rows(table.drop_columns(["response_mask"]), vocab_size=32)  # single-turn: all ones
    assert collate(single, [0, 1])["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    bad = table.set_column(3, "response_mask", pa.array([[1, 0, 2, 1], [1, 1]], pa.list_(pa.int8())))
    with pytest.raises(TrainInputError, match="other than 0 and 1"):
        read_rows(bad, vocab_size=32)


def test_agreement_ignores_masked_tokens():
    from gpu_jobs.stages.agreement import rows_agreement

    rollout, trainer = [[-0.1, -5.0, -0.2]], [[-0.1, -0.5, -0.2]]
    assert rows_agreement(rollout, trainer)["training/rollout_logprobs_diff_max"] == pytest.approx(4.5)
    masked = rows_agreement(rollout, trainer, [[1, 0, 1]])
    assert masked["training/rollout_logprobs_diff_max"] == pytest.approx(0.0, abs=1e-12)
    assert masked["training/agreement_tokens"] == 2


@pytest.mark.slow
@pytest.mark.deepspeed
def test_grpo_with_the_calculator_through_the_stages(tmp_path):
    import torch

    from flows.config import load_run_config
    from gpu_jobs import stages
    from gpu_jobs.models.tool_model import ensure_tool_model
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from gpu_jobs.stages.shell import read
    from storage import read_manifest

    torch.set_num_threads(1)
    cfg = load_run_config(EXAMPLE, tiny_overrides(
        str(tmp_path / "root"), f"model.path={ensure_tool_model()}", "trainer.total_iterations=2",
        "trainer.checkpoint_every=2", "data.val_size=48"))
    run, eng = open_warm(cfg)
    uris = [run_iteration(DirectCalls(run, eng), cfg, k) for k in (1, 2)]

    rollout = read(run, uris[0]["rollout"])
    masks = rollout.column("response_mask").to_pylist()
    assert any(0 in m for m in masks), "no response holds a tool turn"
    assert all(len(m) == n for m, n in zip(masks, rollout.column("response_len").to_pylist()))
    assert all(n <= cfg.rollout.max_response_length for n in rollout.column("response_len").to_pylist())
    metrics = read_manifest(uris[1]["commit"], run.storage).metrics
    assert metrics["multi_turn/tool_call_frac"] > 0.5
    for name in ("actor/pg_loss", "training/rollout_probs_diff_mean", "critic/score/mean"):
        assert name in metrics, name
    # The reward saw the whole conversation and scored the model's final answer.
    scored = read(run, uris[0]["reward"])
    texts, scores = scored.column("response_text").to_pylist(), scored.column("score").to_pylist()
    assert any("<" in t and ">" in t for t in texts) and 0.0 < float(np.mean(scores)) < 1.0

    # Validation uses the tools too: held-out accuracy well above what the model gets without them.
    val = read_manifest(stages.validate(run, eng, 2), run.storage).metrics["val/acc"]
    from gpu_jobs.rollout.agent_loop import AgentLoopEngine
    from gpu_jobs.stages.scoring import greedy_evaluate

    assert isinstance(eng.rollout, AgentLoopEngine)
    prompts, ids = run.prompts(run.val, list(range(len(run.val))), None)
    _, plain = greedy_evaluate(eng.rollout.engine, run.tokenizer, prompts, ids, cfg.reward,
                               cfg.rollout.max_response_length)
    assert val >= plain["val/acc"] + 0.15, (val, plain)
