"""The built-in character-level tokenizer, built in code (nothing is downloaded).

    >>> from gpu_jobs.models import build_tokenizer
    >>> tok = build_tokenizer()
    >>> tok("37+45=")["input_ids"]          # one id per character, no BOS/EOS added
    >>> tok.apply_chat_template([{"role": "user", "content": "37+45="}], tokenize=False)
    '37+45='
"""

from __future__ import annotations

import string

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
PUNCTUATION = ".,:;!?'\"()[]{}_#%&<>@^~|\\$`"
CHARACTERS = string.digits + "+-*/=" + " " + string.ascii_letters + PUNCTUATION

# The model sees a conversation as the concatenated user contents, nothing else: no role
# markers, and add_generation_prompt adds nothing, so "37+45=" is the whole prompt and the
# model answers "82<eos>".
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ message['content'] }}{% endif %}{% endfor %}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first, then one id per character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`; deterministic, ~100 tokens.

    Unknown characters map to `<unk>`. Encoding adds no special tokens (there is no
    post-processor): a prompt is exactly its characters, and the model must produce `<eos>`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    # Split every character into its own token ("isolated" keeps spaces as tokens too).
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without separators
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # generation pads on the left
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
