"""Shared fixtures for the trainer tests: a tiny Qwen2 saved to disk and seeded sample batches.

Run: ``.venv/bin/python -m pytest -q tests/train`` (add ``-m "not slow"`` to skip torchrun).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

VOCAB = 64


def build_tiny(path: str, *, hidden: int = 64, layers: int = 2, seed: int = 0, tied: bool = False) -> str:
    """A random tiny Qwen2ForCausalLM (hidden 64, 2 layers, 4 heads, vocab 64) saved to ``path``;
    ``tied``: lm_head shares the embedding, as in the built-in model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=2 * hidden, max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def make_batch(seed: int = 0, *, prompts: int = 4, n: int = 2, ref: bool = False,
               old: bool = False, max_prompt: int = 6, max_response: int = 7):
    """A GRPO-shaped table: ``prompts`` groups of ``n`` responses of random lengths, per-token
    advantages constant within a response (as outcome advantages are)."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    rows = []
    for g in range(prompts):
        prompt = rng.integers(1, VOCAB, rng.integers(2, max_prompt + 1)).tolist()
        for _ in range(n):
            length = int(rng.integers(1, max_response + 1))
            row = {
                "group_id": f"g{seed}-{g}",
                "prompt_ids": prompt,
                "response_ids": rng.integers(1, VOCAB, length).tolist(),
                "advantages": [float(rng.normal())] * length,
            }
            if ref:
                row["ref_logprobs"] = (-4.2 + 0.1 * rng.normal(size=length)).tolist()
            if old:
                row["old_logprobs"] = (-4.2 + 0.1 * rng.normal(size=length)).tolist()
            rows.append(row)
    schema = {"prompt_ids": pa.list_(pa.int32()), "response_ids": pa.list_(pa.int32())}
    fields = [
        pa.field(k, schema.get(k, pa.string() if k == "group_id" else pa.list_(pa.float32())))
        for k in rows[0]
    ]
    return pa.Table.from_pylist(rows, schema=pa.schema(fields))


def weights_of(trainer) -> dict[str, torch.Tensor]:
    return trainer.gathered_state_dict()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return build_tiny(str(tmp_path_factory.mktemp("tied") / "model"), seed=1, tied=True)


@pytest.fixture(scope="session")
def helpers():
    """The module-level helpers, for test files (importlib mode cannot import conftest)."""
    import types

    return types.SimpleNamespace(build_tiny=build_tiny, make_batch=make_batch, weights_of=weights_of)


def pytest_configure(config):
    # DeepSpeed 0.19 calls the c10d collectives torch 2.13 renamed; the warning is not ours.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.distributed.*` is deprecated:FutureWarning"
    )
