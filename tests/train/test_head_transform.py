"""A model whose forward changes its LM head's output (Gemma 2's logit soft-capping) gets the
log-probs of its own logits, not of the bare head the chunked path calls."""

from __future__ import annotations

import pytest
import torch

from gpu_jobs.train import ActorConfig, PolicyTrainer, RefModel
from gpu_jobs.train.errors import TrainInputError

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def softcapped(tmp_path_factory) -> str:
    """A tiny Gemma2ForCausalLM whose logits are soft-capped at 2 (Gemma 2 uses 30 on logits of
    that size; weights this large make the cap change every token's log-prob here)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tests.train.conftest import VOCAB

    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                       final_logit_softcapping=2.0, initializer_range=0.5)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("gemma2") / "model")
    Gemma2ForCausalLM(cfg).save_pretrained(path)
    return path


def _own_log_probs(path: str, table) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each response token's log-prob under the model's own logits and under its bare LM head's
    output (transformers, row by row)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    own, bare = [], []
    for prompt, response in zip(table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist()):
        labels, rows = torch.tensor(response)[:, None], slice(len(prompt) - 1, -1)
        with torch.no_grad():
            out = model(torch.tensor([prompt + response]), output_hidden_states=True)
            head = model.lm_head(out.hidden_states[-1])
        for logits, into in ((out.logits, own), (head, bare)):
            into.append(torch.log_softmax(logits[0, rows].float(), -1).gather(-1, labels)[:, 0])
    return own, bare


def test_log_probs_of_a_soft_capped_model_are_those_of_its_own_logits(softcapped, helpers):
    table = helpers.make_batch(seed=3, prompts=3, n=2)
    ref = RefModel(softcapped, ActorConfig(use_remove_padding=False))
    assert not ref._chunkable_head  # the forward soft-caps what the head gives
    got = ref.compute_log_probs(table)
    own, bare = _own_log_probs(softcapped, table)
    assert max((o - b).abs().max().item() for o, b in zip(own, bare)) > 0.1  # the cap matters here
    for g, w in zip(got, own):
        assert torch.allclose(torch.from_numpy(g), w, rtol=1e-5, atol=1e-5), (g, w)


def test_chunking_forced_on_a_soft_capped_model_is_refused_by_name(softcapped):
    with pytest.raises(TrainInputError, match="entropy_from_logits_with_chunking=true.*'auto'"):
        PolicyTrainer(softcapped, ActorConfig(use_remove_padding=False, entropy_from_logits_with_chunking=True))


def test_a_plain_model_keeps_the_chunked_head(tiny_model):
    assert RefModel(tiny_model, ActorConfig())._chunkable_head
