"""Incremental detokenisation: the text each new token adds, decoding only a short window.

    text = Detokenizer(tokenizer)
    text.add(token)     # -> what this token added ("" while a character's bytes are incomplete)
    text.flush()        # -> what is left once no token follows (a trailing partial character)
    text.text           # everything emitted so far; == tokenizer.decode(ids, skip_special_tokens=True)

    token_pieces(ids, tokenizer)   # [text token 1 added, token 2, ...]: sums to the whole decode

The offsets are the ones Hugging Face's TGI and vLLM's detokenizer keep: `prefix` is where the
window starts (the token after the last one whose text was complete before the previous emit),
`read` where the text already emitted ends. Each token decodes ids[prefix:] and ids[prefix:read]
and emits the difference unless it ends in U+FFFD (a character whose bytes span tokens, still
incomplete: the token waits for the next one). The window is the tokens since the last emit, so a
sequence of L tokens costs 2L decodes of a few tokens each, not L decodes of up to L tokens.
Starting the window at a token boundary where the text was complete is what makes the pieces add
up to the whole decode for byte-level BPE (GPT-2, SmolLM2, Qwen) and character tokenizers (the
built-in model): tests/serve/test_detok.py checks it on random token sequences of both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Detokenizer", "prefix_lengths", "token_pieces"]


class Detokenizer:
    """The text of one token sequence, built a token at a time (see the module docstring)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token: int) -> str:
        """Take one token; the text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        piece = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text the tokens held back add once the sequence is over (a partial character
        decodes to U+FFFD, as in the whole decode)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        piece = now[len(before):] if len(now) > len(before) else ""
        self.prefix = self.read = len(self.ids)
        self.text += piece
        return piece


def token_pieces(ids: list[int], tokenizer: Any) -> list[str]:
    """What each token of `ids` adds to the text (the last one also what flush adds): the pieces
    sum to tokenizer.decode(ids, skip_special_tokens=True). 2 len(ids) short decodes."""
    text = Detokenizer(tokenizer)
    pieces = [text.add(t) for t in ids]
    if pieces:
        pieces[-1] += text.flush()
    return pieces


def prefix_lengths(ids: list[int], tokenizer: Any) -> list[int]:
    """[characters of the text of ids[:k] for k in 0..len(ids)], from token_pieces (a character
    still incomplete after k tokens is counted once the token completing it arrives)."""
    out = [0]
    for piece in token_pieces(ids, tokenizer):
        out.append(out[-1] + len(piece))
    return out
