"""Fast checks (no DeepSpeed engine): configs, batch validation, collation, batching plans."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from gpu_jobs.train import CriticConfig, ActorConfig, TrainInputError
from gpu_jobs.train.batch import collate, plan_microbatches, plan_minibatches, read_rows


# ---- configs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_with_zero2_or_3_is_rejected_with_the_fix(stage):
    with pytest.raises(ValidationError) as e:
        ActorConfig(zero_stage=stage, pipeline_parallel_size=2)
    msg = str(e.value)
    assert "DeepSpeed cannot combine pipeline parallelism with ZeRO-2/3" in msg
    assert "set zero_stage to 0 or 1" in msg and "pipeline_parallel_size=1" in msg


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_with_zero0_or_1_is_accepted(stage):
    cfg = ActorConfig(zero_stage=stage, pipeline_parallel_size=2)
    assert cfg.deepspeed_config(world_size=2)["zero_optimization"]["stage"] == stage


def test_zero_stage_auto_resolves_per_data_parallel_size():
    auto = ActorConfig()
    assert auto.zero_stage == "auto" and CriticConfig().zero_stage == "auto"
    assert [auto.resolved_zero_stage(n) for n in (1, 2, 8)] == [0, 3, 3]
    assert ActorConfig(dtype="bf16").resolved_zero_stage(1) == 0  # bf16 is autocast over a fp32 engine
    assert ActorConfig(pipeline_parallel_size=2).resolved_zero_stage(2) == 1  # no ZeRO-2/3 with pipes
    assert ActorConfig(zero_stage=3).resolved_zero_stage(1) == 3
    assert auto.deepspeed_config(world_size=1)["zero_optimization"]["stage"] == 0
    assert auto.deepspeed_config(world_size=2)["zero_optimization"]["stage"] == 3


def test_configs_forbid_unknown_fields_and_document_every_field():
    with pytest.raises(ValidationError):
        ActorConfig(learning_rate=1e-5)  # verl calls it lr
    for cls in (ActorConfig, CriticConfig):
        undocumented = [n for n, f in cls.model_fields.items() if not f.description]
        assert undocumented == []


def test_deepspeed_config_sets_clipping_explicitly_and_owns_accumulation():
    ds = ActorConfig(grad_clip=0.5, dtype="bf16").deepspeed_config(world_size=2)  # auto: 3
    assert ds["gradient_clipping"] == 0.5  # DeepSpeed's own default would be 1.0
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_batch_size"] == 2
    assert ds["zero_optimization"]["stage"] == 3
    assert "bf16" not in ds  # the trainer's autocast; DeepSpeed's bf16 only under a pipeline (pipeline.py)


def test_lr_schedules():
    cfg = ActorConfig(lr=1.0, lr_warmup_steps=4)
    assert [cfg.lr_at(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = ActorConfig(lr=1.0, lr_scheduler="cosine", total_training_steps=10, min_lr_ratio=0.1)
    assert cos.lr_at(0) == 1.0 and math.isclose(cos.lr_at(10), 0.1)
    assert math.isclose(cos.lr_at(5), 0.1 + 0.9 * 0.5)  # half way down the cosine
    with pytest.raises(ValidationError, match="total_training_steps"):
        ActorConfig(lr_scheduler="cosine")


# ---- batch validation ------------------------------------------------------------------------
def _table(**cols):
    return pa.table(cols)


def _ok(**extra):
    cols = {
        "prompt_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
        "response_ids": pa.array([[4, 5, 6], [7]], pa.list_(pa.int32())),
        "advantages": pa.array([[1.0, 1.0, 1.0], [-1.0]], pa.list_(pa.float32())),
    }
    cols.update(extra)
    return _table(**cols)


def test_valid_batch_reads():
    rows = read_rows(_ok(), require=("advantages",), vocab_size=64)
    assert len(rows) == 2 and rows.samples_per_prompt == 1
    assert rows.columns["advantages"][0].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "table, needle",
    [
        (_ok().drop(["advantages"]), "missing column(s) ['advantages']"),
        (_ok(advantages=pa.array([[1.0, float("nan"), 1.0], [0.0]], pa.list_(pa.float32()))),
         "'advantages' row 0 token 1 is nan"),
        (_ok().slice(0, 0), "empty batch"),
        (_ok(advantages=pa.array([[1.0, 1.0], [0.0]], pa.list_(pa.float32()))),
         "'advantages' row 0 has 2 values but the response has 3 tokens"),
        (_ok(response_ids=pa.array([[4, 5, 99], [7]], pa.list_(pa.int32()))),
         "outside the model's vocabulary"),
        (_ok(prompt_ids=pa.array([[], [3]], pa.list_(pa.int32()))), "empty prompt"),
        (_ok(advantages=pa.array([None, [0.0]], pa.list_(pa.float32()))), "null in row 0"),
    ],
    ids=["missing-advantages", "nan", "empty", "length-mismatch", "vocab", "empty-prompt", "null"],
)
def test_bad_batches_name_the_problem_and_the_fix(table, needle):
    with pytest.raises(TrainInputError) as e:
        read_rows(table, require=("advantages",), vocab_size=64)
    assert needle in str(e.value)
    assert any(w in str(e.value).lower() for w in ("fix", "recompute", "drop", "check", "roll out", "run"))


def test_group_ids_give_samples_per_prompt():
    t = _ok().append_column("group_id", pa.array(["a", "a"]))
    assert read_rows(t, vocab_size=64).samples_per_prompt == 2


# ---- collation -------------------------------------------------------------------------------
def test_collate_left_pads_prompts_right_pads_responses_and_counts_positions():
    rows = read_rows(_ok(), vocab_size=64)
    mb = collate(rows, [0, 1])
    assert mb["input_ids"].tolist() == [[1, 2, 4, 5, 6], [0, 3, 7, 0, 0]]
    assert mb["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    # the second row's prompt token sits at position 0 although it is the second column
    assert mb["position_ids"][1, 1:3].tolist() == [0, 1]
    assert mb["responses"].tolist() == [[4, 5, 6], [7, 0, 0]]
    assert mb["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb["advantages"].tolist() == [[1, 1, 1], [-1, 0, 0]]
    assert collate(rows, [1], pad_response_to=4)["response_mask"].shape == (1, 4)


def test_packed_collate_concatenates_rows_and_restarts_positions():
    rows = read_rows(_ok(), vocab_size=64)  # prompts [1, 2], [3]; responses [4, 5, 6], [7]
    mb = collate(rows, [0, 1], packed=True)
    assert mb["packed"] and "attention_mask" not in mb
    assert mb["input_ids"].tolist() == [[1, 2, 4, 5, 6, 3, 7]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert mb["cu_seq_lens"].tolist() == [0, 5, 7]
    # row 0's responses are predicted from packed positions 1..3 (token 2, 4, 5), row 1's from 5
    assert mb["token_index"].tolist() == [1, 2, 3, 5]
    assert mb["token_slot"].tolist() == [0, 1, 2, 3]  # (b, R) = (2, 3), flattened
    padded = collate(rows, [0, 1])
    for k in ("responses", "response_mask", "advantages"):
        assert mb[k].tolist() == padded[k].tolist(), k


# ---- plans -----------------------------------------------------------------------------------
def test_minibatch_plan_is_a_seeded_permutation():
    import torch

    a = plan_minibatches(10, 4, torch.Generator().manual_seed(3))
    b = plan_minibatches(10, 4, torch.Generator().manual_seed(3))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [len(x) for x in a] == [4, 4, 2]
    assert sorted(np.concatenate(a).tolist()) == list(range(10))
    assert np.concatenate(plan_minibatches(5, 2, None)).tolist() == [0, 1, 2, 3, 4]


def test_dynamic_microbatches_respect_the_token_budget():
    rng = np.random.default_rng(0)
    n = 20
    t = _table(
        prompt_ids=pa.array([rng.integers(1, 9, rng.integers(1, 8)).tolist() for _ in range(n)], pa.list_(pa.int32())),
        response_ids=pa.array([rng.integers(1, 9, rng.integers(1, 12)).tolist() for _ in range(n)], pa.list_(pa.int32())),
    )
    rows = read_rows(t, vocab_size=64)
    micros = plan_microbatches(rows, range(n), micro_size=None, max_tokens=40)
    assert sorted(i for m in micros for i in m) == list(range(n))
    for m in micros:
        p, r = rows.lengths(m)
        assert len(m) == 1 or len(m) * (p.max() + r.max()) <= 40
    packed = plan_microbatches(rows, range(n), micro_size=None, max_tokens=40, packed=True)
    assert sorted(i for m in packed for i in m) == list(range(n))
    for m in packed:  # packed rows cost their real tokens, so more of them fit
        p, r = rows.lengths(m)
        assert len(m) == 1 or (p + r).sum() <= 40
    assert len(packed) < len(micros)
    fixed = plan_microbatches(rows, range(n), micro_size=6, max_tokens=None)
    assert [len(m) for m in fixed] == [6, 6, 6, 2]


def test_gradient_checkpointing_auto_turns_on_where_activations_pass_the_budget():
    """'auto' estimates one micro-batch's activations (ppo_max_token_len_per_gpu tokens x layers x
    hidden x 88 B): on for SmolLM2-135M, off for the built-in model, on where the config does not
    say its size; true/false are taken as given."""
    from types import SimpleNamespace

    from gpu_jobs.train.config import ACTIVATION_BUDGET_BYTES, ACTIVATION_BYTES_PER_UNIT

    builtin, smollm2 = SimpleNamespace(num_hidden_layers=2, hidden_size=128), SimpleNamespace(num_hidden_layers=30, hidden_size=576)
    auto = ActorConfig()
    assert auto.gradient_checkpointing == "auto"
    assert not auto.checkpoints_layers(builtin) and auto.checkpoints_layers(smollm2)
    assert auto.checkpoints_layers(SimpleNamespace())
    # the boundary is the budget: one token more than fits turns it on
    fits = ACTIVATION_BUDGET_BYTES // (ACTIVATION_BYTES_PER_UNIT * 2 * 128)
    assert not ActorConfig(ppo_max_token_len_per_gpu=fits).checkpoints_layers(builtin)
    assert ActorConfig(ppo_max_token_len_per_gpu=fits + 1).checkpoints_layers(builtin)
    assert ActorConfig(gradient_checkpointing=True).checkpoints_layers(builtin)
    assert not ActorConfig(gradient_checkpointing=False).checkpoints_layers(smollm2)
