"""Offline preference runs (DPO, KTO) through the stage layer: the `preference:` section's
refusals, the batch layout (a pair never split, KTO's mismatched rows), micro-batches of whole
units in the update, runs on the built-in model whose held-out implicit-reward accuracy rises
(stopped on that measure), a resume that replays the committed update, and one Prefect flow run.

    .venv/bin/python -m pytest -q tests/flows/test_preference_run.py
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from tests.tiny import REPO

DPO_EXAMPLE, KTO_EXAMPLE = REPO / "examples" / "dpo_feedback.yaml", REPO / "examples" / "kto_feedback.yaml"
# The examples' batches (32 pairs or examples an iteration, 16 per forward) on less data.
SMALL = ["preference.train_size=512", "preference.val_size=64", "trainer.tensorboard=false"]


def _config(example: Path, root: Path, *extra: str):
    from flows.config import load_run_config

    return load_run_config(str(example), [f"root={root}", *SMALL, *extra])


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("section, named", [
    ({"critic": {}}, "remove the critic section"),
    ({"actor": {"kl_loss": {"use_kl_loss": True}}}, "preference.beta"),
    ({"data": {"train_files": ["prompts.parquet"]}}, "preference.train_files"),
    ({"actor": {"use_dynamic_bsz": True}}, "whole pairs"),
    ({"trainer": {"n_gpus_per_node": 2}}, "one colocated rank"),
    ({"rollout": {"temperature": 0.7}}, "temperature 1"),
    ({"preference": {"algorithm": "kto"}, "actor": {"ppo_micro_batch_size_per_gpu": 1}}, "mismatched pairs"),
    ({"preference": {"algorithm": "kto", "loss_type": "ipo"}}, "only to algorithm='dpo'"),
    ({"preference": {"generate": None}}, "preference.train_files is empty"),
])
def test_bad_combinations_are_one_line_naming_the_fix(section, named):
    from flows.user_errors import user_error_line
    from gpu_jobs.stages.config import ConfigError, build_run_config

    data = {"preference": {}, **section}
    with pytest.raises(ConfigError) as err:
        build_run_config(data, check_files=False)
    line = user_error_line(err.value)
    assert named in line and "\n" not in line, line


def test_the_cli_refuses_before_any_work(tmp_path):
    from flows.cli import main

    with pytest.raises(SystemExit) as err:
        main(["train", "--config", str(DPO_EXAMPLE), f"root={tmp_path}", "critic.lr=1e-5"])
    assert str(err.value.code).startswith("rlmill: ") and "critic" in str(err.value.code)
    assert not any(tmp_path.iterdir())


def _write(path: Path, rows: list[dict]) -> str:
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("rows, algorithm, named", [
    # A verl prompt file given to DPO: no pairs in it.
    ([{"data_source": "x", "prompt": [{"role": "user", "content": "1+1="}]}], "dpo", "no chosen, rejected column"),
    # KTO rows given to DPO: the line says which algorithm they are for.
    ([{"prompt": "1+1=", "completion": "2", "label": True}], "dpo", "kto's columns, set preference.algorithm=kto"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "2"}], "dpo", "row 0: chosen and rejected are the same"),
    ([{"prompt": "1+1=", "completion": "2", "label": "yes"}], "kto", "label must be true"),
])
def test_a_bad_preference_file_is_one_line_before_any_model_loads(tmp_path, rows, algorithm, named):
    from flows.config import load_run_config
    from flows.user_errors import user_error_line
    from gpu_jobs.stages.preference_data import preference_frames

    url = _write(tmp_path / "prefs.parquet", rows)
    example = DPO_EXAMPLE if algorithm == "dpo" else KTO_EXAMPLE
    cfg = load_run_config(str(example), [f"root={tmp_path}", f"preference.train_files=[{url}]"])
    with pytest.raises(Exception) as err:
        preference_frames(cfg)
    line = user_error_line(err.value, cfg)
    assert line is not None and named in line and url in line, line


# ------------------------------------------------------------------------------ the batch layout
@pytest.fixture(scope="module")
def tokenizer():
    from gpu_jobs.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("builtin"))


def test_a_dpo_unit_is_one_pair_with_one_prompt(tokenizer):
    from gpu_jobs.data.preferences import arith_preference_rows
    from gpu_jobs.stages.preference_data import answer_ids, preference_table

    rows = arith_preference_rows("dpo", [(12, 30), (45, 51), (10, 99)], seed=0)
    t = preference_table(rows, tokenizer, "dpo", micro_size=2, max_prompt_length=None).to_pylist()
    assert [(r["unit"], r["role"]) for r in t] == [(u, role) for u in range(3) for role in ("chosen", "rejected")]
    for u in range(3):
        chosen, rejected = t[2 * u], t[2 * u + 1]
        assert chosen["prompt_ids"] == rejected["prompt_ids"]
        assert chosen["response_ids"] == answer_ids(rows[u]["chosen"], tokenizer)
        assert rejected["response_ids"] == answer_ids(rows[u]["rejected"], tokenizer)
        assert chosen["response_ids"][-1] == tokenizer.eos_token_id  # an answer ends where the model would stop


def test_a_kto_unit_holds_its_examples_and_their_mismatched_rows(tokenizer):
    from gpu_jobs.stages.preference_data import preference_table

    # Five examples in groups of 2: the last one joins the group before it (a group of one has
    # no mismatched pair), so the units are [0, 1] and [2, 3, 4].
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1 + (i % 2)), "label": i % 2 == 0}
            for i, a in enumerate((10, 20, 30, 40, 50))]
    t = preference_table(rows, tokenizer, "kto", micro_size=2, max_prompt_length=None).to_pylist()
    units = {}
    for r in t:
        units.setdefault(r["unit"], []).append(r)
    assert [[r["row"] for r in u if r["role"] != "kl"] for u in units.values()] == [[0, 1], [2, 3, 4]]
    by_row = {r["row"]: r for r in t if r["role"] != "kl"}
    assert [by_row[i]["role"] for i in range(5)] == ["desirable", "undesirable"] * 2 + ["desirable"]
    for members in units.values():
        examples = [r for r in members if r["role"] != "kl"]
        kl = [r for r in members if r["role"] == "kl"]
        assert [r["row"] for r in kl] == [r["row"] for r in examples]  # one per example, its own prompt
        n = len(examples)
        for j, (ex, mismatched) in enumerate(zip(examples, kl)):
            assert mismatched["prompt_ids"] == ex["prompt_ids"]
            # TRL's rotation: example j is paired with the completion of example j-1 of its group.
            assert mismatched["response_ids"] == examples[(j - 1) % n]["response_ids"] != ex["response_ids"]


# ------------------------------------------------------------------------------ runs
def _learn_until(run, roles, cfg, bound: int, collate_log: list | None = None) -> list[dict]:
    """Iterations until the held-out implicit-reward accuracy reaches 0.6 with a positive mean
    margin (0 and 0 before training: the policy is the reference), at most `bound`."""
    from gpu_jobs.stages import DirectCalls, run_iteration, validate
    from storage import read_manifest

    history = [read_manifest(validate(run, roles, 0), run.storage).metrics]
    assert history[0]["val/rewards/accuracies"] == 0.0 and history[0]["val/rewards/margins"] == 0.0
    for k in range(1, bound + 1):
        uris = run_iteration(DirectCalls(run, roles), cfg, k)
        history.append({**read_manifest(validate(run, roles, k), run.storage).metrics,
                        **read_manifest(uris["commit"], run.storage).metrics})
        if history[-1]["val/rewards/accuracies"] >= 0.6 and history[-1]["val/rewards/margins"] > 0:
            return history
    shown = [(round(h["val/rewards/accuracies"], 3), round(h["val/rewards/margins"], 4)) for h in history]
    raise AssertionError(f"held-out accuracy never reached 0.6 with a positive margin in {bound} iterations: {shown}")


def _record_micro_batches(roles, monkeypatch) -> list[list[int]]:
    """The rows of each micro-batch the update trains on (with grad: not the log-prob passes)."""
    import torch

    seen: list[list[int]] = []
    real = roles.trainer._collate

    def collate(rows, micro, *args, **kwargs):
        if torch.is_grad_enabled():
            seen.append(list(micro))
        return real(rows, micro, *args, **kwargs)

    monkeypatch.setattr(roles.trainer, "_collate", collate)
    return seen


def _units_whole(table: pa.Table, micros: list[list[int]]) -> list[int]:
    units = table.column("unit").to_pylist()
    rows_of: dict[int, set[int]] = {}
    for i, u in enumerate(units):
        rows_of.setdefault(u, set()).add(i)
    sizes = []
    for micro in micros:
        in_micro = {units[i] for i in micro}
        assert set(micro) == set().union(*(rows_of[u] for u in in_micro)), f"micro-batch {micro} splits a unit"
        sizes.append(len(in_micro))
    return sizes


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("example", [DPO_EXAMPLE, KTO_EXAMPLE], ids=["dpo", "kto"])
def test_a_run_learns_its_preferences_in_whole_units(tmp_path, monkeypatch, example):
    import torch

    from gpu_jobs.stages import open_warm
    from storage import committed, read_table

    torch.set_num_threads(1)
    cfg = _config(example, tmp_path / "root", "trainer.checkpoint_every=1000")
    run, roles = open_warm(cfg)
    try:
        assert roles.rollout is None  # nothing is generated: no engine is loaded
        micros = _record_micro_batches(roles, monkeypatch)
        history = _learn_until(run, roles, cfg, bound=30)
        first = read_table(committed(run.layout.stage(1, "preference_ref"), run.storage), storage=run.storage)
        sizes = _units_whole(first, micros[: len(micros) // (len(history) - 1)])
        # DPO: 16 pairs per forward; KTO: one group of 16 examples (and their 16 mismatched rows).
        assert sizes == ([16, 16] if cfg.preference.algorithm == "dpo" else [1, 1])
        last = history[-1]
        assert {"rewards/accuracies", "rewards/margins", "actor/preference_loss", "timing_s/ref"} <= last.keys()
        monkeypatch.undo()
        _resume_replays_the_same_weights(cfg, roles, len(history) - 1)
    finally:
        roles.close()


def _resume_replays_the_same_weights(cfg, roles, k: int) -> None:
    """A fresh process's view: no checkpoint was written (checkpoint_every=1000), so restore
    replays every committed update from its preference_ref table, to the same weights bitwise."""
    import torch

    from gpu_jobs.stages import open_warm

    _, again = open_warm(cfg)
    try:
        assert again.version == k
        mine, theirs = roles.trainer.gathered_state_dict(), again.trainer.gathered_state_dict()
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    finally:
        again.close()


@pytest.mark.e2e  # ~15 s of CPU, but 40 s of wall time on 2 busy cores (three validations, two subflows)
@pytest.mark.prefect
@pytest.mark.deepspeed
def test_the_rl_training_flow_runs_a_dpo_run(tmp_path):
    """The same stages as Prefect tasks (the session's Prefect server): validation before and
    after, each iteration's stage folders, nothing rolled out."""
    from flows.training import rl_training

    root = tmp_path / "root"
    summary = rl_training(config=str(DPO_EXAMPLE), overrides=[f"root={root}", *SMALL, "run_id=dpo-flow"],
                          iterations=2)
    assert summary["val/acc before"] == 0.0 and summary["val/acc after"] > 0.0
    it = root / "runs" / "dpo-flow" / "iterations"
    assert sorted(p.name for p in (it / "2").iterdir() if p.is_dir()) == ["commit", "preference_batch",
                                                                          "preference_ref", "update", "validate"]


@pytest.mark.slow
@pytest.mark.deepspeed
def test_with_lora_the_reference_is_the_base_model_however_far_the_adapter_trained(tmp_path):
    """Iteration 3's reference log-probs (the actor with its adapter off, after two updates)
    equal the start model's own on the same batch: the reference never drifts with the adapter."""
    import numpy as np
    import torch

    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from gpu_jobs.train import RefModel
    from storage import read_table

    torch.set_num_threads(1)
    cfg = _config(DPO_EXAMPLE, tmp_path / "root", "model.lora_rank=8", "actor.lr=1e-3", "trainer.checkpoint_every=1000")
    run, roles = open_warm(cfg)
    try:
        uris = [run_iteration(DirectCalls(run, roles), cfg, k) for k in (1, 2, 3)]
        table = read_table(uris[-1]["preference_ref"], storage=run.storage)
        base = RefModel(run.model_path, cfg.actor, tokenizer=run.tokenizer).compute_log_probs(table)
        committed_ref = table.column("ref_logprobs").to_pylist()
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(base, committed_ref))
        policy = roles.trainer.compute_log_probs(table)
        assert max(float(np.abs(p - b).max()) for p, b in zip(policy, base)) > 1e-3  # the adapter did train
    finally:
        roles.close()


def test_an_overlong_prompt_is_refused_before_the_run_exists(tmp_path):
    from flows.user_errors import user_error_line
    from gpu_jobs.stages import Run

    url = _write(tmp_path / "prefs.parquet", [{"prompt": "1+1=" * 40, "chosen": "2", "rejected": "3"}] * 20)
    cfg = _config(DPO_EXAMPLE, tmp_path / "root", f"preference.train_files=[{url}]", "preference.val_size=2",
                  "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "data.max_prompt_length=64")
    with pytest.raises(Exception) as err:
        Run.open(cfg)
    assert "data.max_prompt_length=64" in user_error_line(err.value, cfg)
    assert not (tmp_path / "root" / "runs").exists()
