"""Fixtures shared by the rollout tests: the built-in model, prompts, a teacher-forced reference."""

from __future__ import annotations

import pytest
import torch

from gpu_jobs.models import arith_problems, ensure_builtin_model, load_model


@pytest.fixture(scope="session")
def builtin_path() -> str:
    return ensure_builtin_model()  # cached on disk after the first build


@pytest.fixture(scope="session")
def builtin(builtin_path):
    model, tok = load_model(builtin_path)
    return model, tok


@pytest.fixture(scope="session")
def prompts(builtin):
    """Six arithmetic prompts plus two of other lengths, so left padding is exercised."""
    _, tok = builtin
    texts = [p for p, _ in arith_problems(6, seed=99)] + ["5+7=", "hello world, 12+34="]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def teacher_forced_logprobs(model, row, temperature: float, top_k: int = -1,
                            top_p: float = 1.0) -> torch.Tensor:
    """log_softmax(filter(logits / temperature)) of each response token given its prefix, from
    one unpadded forward pass: the reference the rollout logprobs must match; (response_len,)."""
    from gpu_jobs.rollout.hf_engine import filter_top_k_top_p

    ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    start = len(row["prompt_ids"])
    logits = logits[start - 1:-1] / (temperature or 1.0)
    if temperature:
        logits = filter_top_k_top_p(logits, top_k, top_p)
    targets = torch.tensor(row["response_ids"])
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.fixture(scope="session")
def teacher_forced():
    """The reference function above (a fixture: importlib mode cannot import conftest)."""
    return teacher_forced_logprobs
