"""The sequence-classifier reward model, on a tiny randomly initialised model built here."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from gpu_jobs.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(cfg)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_scores_are_finite_deterministic_and_do_not_depend_on_padding(reward_model_dir):
    from gpu_jobs.reward import ModelRewardScorer

    scorer = ModelRewardScorer(reward_model_dir, max_length=64, batch_size=4)
    prompts = ["37+45=", [{"role": "user", "content": "12+30="}], "99+99=", "10+10="]
    responses = ["82", "42", "198 is the sum", "2"]
    scores = scorer.score(prompts, responses)
    assert len(scores) == 4 and all(isinstance(s, float) and s == s for s in scores)
    assert scorer.score(prompts, responses) == scores
    # scored alone (no padding) equals scored in a padded batch: the last real token is used
    alone = [scorer.score([p], [r])[0] for p, r in zip(prompts, responses)]
    assert alone == pytest.approx(scores, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) > 1  # different texts, different scores
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        scorer.score(["a", "b"], ["c"])
