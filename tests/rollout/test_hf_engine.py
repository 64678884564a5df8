"""The "hf" rollout backend and the shared interface (no vLLM needed).

    .venv/bin/python -m pytest -q tests/rollout -m "not vllm"
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_jobs.models import build_tiny_model
from gpu_jobs.rollout import (
    HFRolloutEngine,
    RolloutEngineConfig,
    RolloutEngine,
    SamplingConfig,
    get_rollout_engine,
    register_rollout_engine,
)
from gpu_jobs.rollout.hf_engine import filter_top_k_top_p, sample_tokens

GREEDY = SamplingConfig(temperature=0.0, max_response_length=8)


@pytest.fixture(scope="module")
def engine(builtin):
    model, tok = builtin
    return HFRolloutEngine(model, tok)


def _responses(rows):
    return [r["response_ids"] for r in rows]


def test_rows_are_prompt_major_with_the_contract_fields(engine, prompts):
    rows = engine.generate(prompts, n=3, sampling=SamplingConfig(max_response_length=5, seed=0))
    assert len(rows) == 3 * len(prompts)
    assert isinstance(engine, RolloutEngine)
    for k, row in enumerate(rows):
        assert (row["prompt_index"], row["sample_index"]) == (k // 3, k % 3)
        assert row["prompt_ids"] == prompts[k // 3]
        assert len(row["rollout_logprobs"]) == len(row["response_ids"]) >= 1
        assert row["finish_reason"] in ("stop", "length")
        assert all(isinstance(t, int) for t in row["response_ids"])


def test_greedy_equals_model_generate_with_left_padding(engine, builtin, prompts):
    model, tok = builtin
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    rows = engine.generate(prompts, n=1, sampling=GREEDY)
    for row, out in zip(rows, ref[:, width:].tolist()):
        expected = out[:len(row["response_ids"])]
        assert row["response_ids"] == expected
        if row["finish_reason"] == "stop":  # generate pads after EOS
            assert set(out[len(expected):]) <= {tok.pad_token_id}


def test_builtin_model_answers_some_problems(engine, builtin, prompts):
    _, tok = builtin
    rows = engine.generate(prompts[:6], n=1, sampling=GREEDY)
    texts = [tok.decode(r["response_ids"], skip_special_tokens=True) for r in rows]
    assert all(t.isdigit() for t in texts), texts  # it learned the answer format
    assert all(r["finish_reason"] == "stop" for r in rows)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, -1, 1.0),
                                                     (1.0, 4, 1.0), (1.2, -1, 0.8), (0.9, 6, 0.9)])
def test_logprobs_match_teacher_forcing(engine, builtin, prompts, teacher_forced, temperature, top_k,
                                        top_p):
    model, _ = builtin
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              max_response_length=8, seed=1)
    for row in engine.generate(prompts, n=2, sampling=sampling):
        ref = teacher_forced(model, row, temperature, top_k, top_p)
        assert torch.allclose(torch.tensor(row["rollout_logprobs"]), ref, atol=1e-4)


def test_top_k_1_equals_greedy(engine, prompts):
    greedy = engine.generate(prompts, n=1, sampling=GREEDY)
    topk1 = engine.generate(prompts, n=2, sampling=SamplingConfig(top_k=1, max_response_length=8, seed=3))
    assert _responses(topk1)[::2] == _responses(greedy) == _responses(topk1)[1::2]
    # the sampling distribution was a point mass: logprob 0
    assert all(lp == 0.0 for r in topk1 for lp in r["rollout_logprobs"])


def test_seed_reproducibility(engine, prompts):
    s = SamplingConfig(temperature=1.0, max_response_length=8, seed=11)
    a, b = engine.generate(prompts, 4, s), engine.generate(prompts, 4, s)
    c = engine.generate(prompts, 4, s.model_copy(update={"seed": 12}))
    assert a == b
    assert _responses(a) != _responses(c)
    # samples of one prompt differ from each other (they are not copies of one stream); at
    # temperature 2 the distribution is flat enough, so this holds for any trained weights
    hot = engine.generate(prompts, 4, s.model_copy(update={"temperature": 2.0}))
    assert len({tuple(r["response_ids"]) for r in hot if r["prompt_index"] == 7}) > 1


def test_finish_reasons_and_eos(engine, builtin, prompts):
    _, tok = builtin
    # 3 tokens: room for a 2-digit answer + EOS ("stop"), not for a 3-digit one ("length")
    rows = engine.generate(prompts, 4, SamplingConfig(max_response_length=3, seed=5))
    for r in rows:
        eos_at = [i for i, t in enumerate(r["response_ids"]) if t == tok.eos_token_id]
        if r["finish_reason"] == "stop":
            assert eos_at == [len(r["response_ids"]) - 1]  # EOS included, last, once
        else:
            assert eos_at == [] and len(r["response_ids"]) == 3
    assert {r["finish_reason"] for r in rows} == {"stop", "length"}
    long = engine.generate(prompts[:2], 2, SamplingConfig(max_response_length=12, seed=5, ignore_eos=True))
    assert all(len(r["response_ids"]) == 12 and r["finish_reason"] == "length" for r in long)


@pytest.mark.parametrize("config", [RolloutEngineConfig(compact_fraction=1.0), RolloutEngineConfig(max_batch_size=3),
                                    RolloutEngineConfig(compact_fraction=0.01)])
def test_batching_and_row_dropping_do_not_change_greedy_output(builtin, prompts, config, engine):
    model, tok = builtin
    other = HFRolloutEngine(model, tok, config)
    s = SamplingConfig(temperature=0.0, max_response_length=10)
    got, ref = other.generate(prompts, 2, s), engine.generate(prompts, 2, s)
    assert _responses(got) == _responses(ref)
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in ref]
    for a, b in zip(got, ref):  # batch shape changes float reduction order a little
        assert torch.allclose(torch.tensor(a["rollout_logprobs"]), torch.tensor(b["rollout_logprobs"]),
                              atol=1e-5)


def test_update_weights_from_state_dict_and_folder(builtin, prompts, tmp_path):
    model, tok = builtin
    own, _ = build_tiny_model()  # a private copy: the session model stays untouched
    own.load_state_dict(model.state_dict())
    engine = HFRolloutEngine(own, tok)
    before = engine.generate(prompts, 1, GREEDY)
    gen = torch.Generator().manual_seed(0)
    # lm_head is tied to the embeddings: leave it out so both names cannot disagree
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen)
                 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(perturbed)
    after = engine.generate(prompts, 1, GREEDY)
    assert _responses(after) != _responses(before)
    model.save_pretrained(tmp_path)  # the original weights, as a checkpoint folder
    engine.update_weights(str(tmp_path))
    assert engine.generate(prompts, 1, GREEDY) == before
    with pytest.raises(KeyError, match="unexpected"):
        engine.update_weights({"not.a.weight": torch.zeros(1)})


def test_engine_shares_an_in_memory_module(builtin, prompts):
    model, tok = builtin
    own, _ = build_tiny_model()
    own.load_state_dict(model.state_dict())
    engine = HFRolloutEngine(own, tok)
    before = engine.generate(prompts, 1, GREEDY)
    with torch.no_grad():  # an "optimizer step" on the trainer's module
        own.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert _responses(engine.generate(prompts, 1, GREEDY)) != _responses(before)
    own.train()
    engine.generate(prompts[:1], 1, GREEDY)
    assert own.training  # the module's mode is restored


def test_registry_builds_from_path_and_rejects_unknown_names(builtin, builtin_path, prompts):
    eng = get_rollout_engine("hf", builtin_path, RolloutEngineConfig())
    assert len(eng.generate(prompts[:2], 2, GREEDY)) == 4
    model, tok = builtin
    from_module = get_rollout_engine("hf", model, tokenizer=tok)
    assert from_module.model is model  # shared, not copied
    assert _responses(from_module.generate(prompts, 1, GREEDY)) == _responses(eng.generate(prompts, 1, GREEDY))
    with pytest.raises(ValueError, match=r"valid names are: hf, vllm"):
        get_rollout_engine("sglang", builtin_path)
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_engine("hf")(lambda *a: None)


def test_filter_top_k_top_p_by_hand():
    # probs 0.5, 0.25, 0.125, 0.125: top-p 0.7 keeps the two most likely (0.75 >= 0.7)
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    kept = filter_top_k_top_p(logits, -1, 0.7)
    assert torch.isinf(kept).tolist() == [[True, False, True, False]]
    kept = filter_top_k_top_p(logits, 3, 1.0)  # ties at the k-th value are kept
    assert torch.isfinite(kept).sum() == 4
    kept = filter_top_k_top_p(logits, 1, 1.0)
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]
    # reported logprob is under the renormalised filtered distribution: 0.5 / 0.75
    tokens, logps = sample_tokens(logits, SamplingConfig(top_p=0.7), torch.Generator().manual_seed(0))
    expected = {1: math.log(0.5 / 0.75), 3: math.log(0.25 / 0.75)}
    assert logps.item() == pytest.approx(expected[tokens.item()], abs=1e-6)


def test_sampling_config_validation():
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingConfig(top_k=-5)
    with pytest.raises(ValueError):
        SamplingConfig(unknown_field=1)


def _storage_checkpoint_api():
    try:
        from storage import save_checkpoint  # noqa: F401
    except Exception:  # storage is written concurrently: skip until its API is there
        return False
    return True


@pytest.mark.skipif(not _storage_checkpoint_api(), reason="storage checkpoint API not available")
def test_update_weights_from_storage_url(builtin, prompts, tmp_path):
    from storage import save_checkpoint

    model, tok = builtin
    gen = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen)
                 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    url = f"memory://rlmill-test-rollout/{tmp_path.name}/policy"
    save_checkpoint(url, perturbed, config=model.config, tokenizer=tok)
    a, _ = build_tiny_model()
    b, _ = build_tiny_model()
    ea, eb = HFRolloutEngine(a, tok), HFRolloutEngine(b, tok)
    ea.update_weights(perturbed)
    eb.update_weights(url)
    assert ea.generate(prompts, 1, GREEDY) == eb.generate(prompts, 1, GREEDY)


@pytest.mark.parametrize("cuda", [False, True])
def test_a_model_loaded_from_a_path_goes_where_torch_sees_a_device(builtin_path, monkeypatch, cuda):
    # This machine has no GPU, so the CUDA side records where the model is sent instead of moving it;
    # without the move the engine would decode on the CPU of a GPU machine (found for gpu-check).
    import torch

    sent = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    real_to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **kw: sent.append(a[0]) or real_to(self, "cpu"))
    engine = HFRolloutEngine(builtin_path)
    assert sent == ["cuda" if cuda else "cpu"]
    assert next(engine.model.parameters()).device.type == "cpu"
