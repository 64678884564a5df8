"""gpu_jobs.models.smollm2_tools: the SmolLM2 Hermes tool warm-up (demonstrations, stopping rule).

    .venv/bin/python -m pytest -q tests/models/test_smollm2_tools.py
"""

from __future__ import annotations

import functools

import pytest

from gpu_jobs.data.rendering import render_prompt
from gpu_jobs.models import ensure_builtin_model
from gpu_jobs.models import smollm2_tools as st
from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig
from gpu_jobs.rollout.base import SamplingConfig
from gpu_jobs.chat.hermes import call_text, parse_calls


@functools.lru_cache(maxsize=None)  # loaded once per session; the tests only read them
def _tokenizer(which: str):
    from transformers import AutoTokenizer

    if which == "smollm2":
        from gpu_jobs.models.loading import ensure_smollm2, smollm2_available

        if not smollm2_available():
            pytest.skip("SmolLM2 is not installed (make smollm2)")
        return AutoTokenizer.from_pretrained(ensure_smollm2())
    return AutoTokenizer.from_pretrained(ensure_builtin_model())


class ReplayEngine:
    """A "model" that samples the given turns in order (one per engine call), each kept as is."""

    def __init__(self, turns):
        self.turns = list(turns)

    def generate(self, prompts, n, sampling):
        turn = self.turns.pop(0)
        return [{"prompt_index": i, "sample_index": 0, "prompt_ids": list(p), "response_ids": list(turn),
                 "rollout_logprobs": [-1.0] * len(turn), "finish_reason": "stop"} for i, p in enumerate(prompts)]

    def score_tokens(self, sequences, temperature):
        return [[-2.0] * (len(s) - 1) for s in sequences]


@pytest.mark.parametrize("which", ["builtin", "smollm2"])
def test_demonstration_is_what_the_hermes_rollout_builds(which):
    """The demonstration's ids and mask are exactly the agent loop's prompt + response and
    [0]*prompt + response_mask when the model samples the demonstration's own turns."""
    tok = _tokenizer(which)
    turns = st.hermes_turns(tok)
    question, expr, answer = st.demo_problems(1, seed=3)[0]
    ids, mask = st.demonstration(tok, turns, question, expr, answer)
    model_runs, run, prev = [], [], 0
    for t, m in zip(ids, mask):  # the mask-1 runs: what the model samples, turn by turn
        if m:
            run.append(t)
        elif prev:
            model_runs.append(run)
            run = []
        prev = m
    model_runs.append(run)
    assert len(model_runs) == 2 and all(r[-1] == tok.eos_token_id for r in model_runs)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert model_runs == [enc(call_text("calculator", {"expression": expr})) + [tok.eos_token_id],
                          enc(answer) + [tok.eos_token_id]]
    messages = [{"role": "user", "content": question}]
    loop = AgentLoopEngine(ReplayEngine(model_runs), MultiTurnConfig(enable=True, format="hermes",
                                                                     tools=["calculator"]), tok)
    row = loop.generate([render_prompt(messages, tok)], 1, SamplingConfig(max_response_length=512, seed=0),
                        rows=[{"prompt": messages}])[0]
    assert row["prompt_ids"] + row["response_ids"] == ids
    assert [0] * len(row["prompt_ids"]) + row["response_mask"] == mask
    assert row["prompt_ids"] == st.prompt_ids(tok, turns, question)


def test_demonstrations_teach_another_family_than_the_probe():
    demos = st.demo_problems(200, seed=0)
    assert all((" plus " in q) != (" minus " in q) and " times " not in q for q, _, _ in demos)
    assert all(str(eval(e)) == a for _, e, a in demos)  # noqa: S307 - our own digits and +/-
    probe = st.probe_problems(16)
    assert all(" times " in q and q.endswith("Use the calculator, then answer with only the number.") for q, _ in probe)


def _tiny_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_builtin_model()
    return AutoModelForCausalLM.from_pretrained(path, dtype="float32"), AutoTokenizer.from_pretrained(path)


def test_warmup_stops_on_the_probe_rate_and_raises_at_max_steps():
    model, tok = _tiny_model()
    seen = []

    def probe(model, tok, turns, problems, exact=False):
        seen.append(exact)
        return (1.0, 0.25) if exact else (0.0 if len(seen) < 2 else 0.75, None)

    recipe = st.SmolToolsRecipe(batch_size=2, check_every=2, max_steps=10, probe_size=4, target_call_rate=0.5)
    info = st.warmup_smollm2_tools(model, tok, recipe, probe_fn=probe)
    assert info["steps"] == 4 and info["probe_call_rate"] == 0.75 and info["probe_exact_match"] == 0.25
    assert seen == [False, False, True] and [c[0] for c in info["checks"]] == [2, 4]
    never = lambda *a, exact=False: (0.0, None)  # noqa: E731
    with pytest.raises(st.ToolWarmupNotReachedError, match="never reached 0.5 in 4 steps"):
        st.warmup_smollm2_tools(model, tok, st.SmolToolsRecipe(batch_size=2, check_every=2, max_steps=4,
                                                               target_call_rate=0.5),
                                probe_fn=never)


def test_probe_rates_parse_the_calls_against_the_schemas():
    """The real probe on the tiny model: it never calls (0.0), and runs end to end."""
    model, tok = _tiny_model()
    turns = st.hermes_turns(tok)
    rate, exact = st.probe_rates(model, tok, turns, st.probe_problems(2), exact=True)
    assert rate == 0.0 and exact == 0.0
    good = call_text("calculator", {"expression": "123*456"})
    assert parse_calls(good, turns.schemas) and not parse_calls("56088", turns.schemas)


def test_the_alias_names_the_seeds_cached_folder(monkeypatch, tmp_path):
    # model.path=smollm2-tools with model.seed=s is the warm-up of SmolToolsRecipe(seed=s): a folder
    # built before is returned as it is, each seed its own (nothing is built here).
    from gpu_jobs.models.loading import MODEL_ALIASES, resolve_model_path

    monkeypatch.setenv("RLMILL_CACHE_DIR", str(tmp_path))
    for seed in (0, 1):
        folder = tmp_path / "models" / f"smollm2-tools-{st.SmolToolsRecipe(seed=seed).digest()}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        assert resolve_model_path("smollm2-tools", seed=seed) == str(folder)
    assert st.SmolToolsRecipe(seed=0).digest() != st.SmolToolsRecipe(seed=1).digest()
    assert "warmed up" in MODEL_ALIASES["smollm2-tools"].what
