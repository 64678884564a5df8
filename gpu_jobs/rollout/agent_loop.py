"""Multi-turn rollouts with tools (verl's tool agent loop), over any rollout engine.

    >>> from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig
    >>> engine = AgentLoopEngine(get_rollout_engine("hf", path), MultiTurnConfig(enable=True), tokenizer)
    >>> rows = engine.generate(prompt_ids, n=8, sampling=SamplingConfig(max_response_length=40, seed=0))
    >>> rows[0]["response_mask"]     # 1 = the model's token, 0 = a tool turn's

One assistant turn is generated until EOS (the end of a chat model's turn). The calls in a turn
are parsed by the call format (gpu_jobs.chat.turn_formats: `brackets`, "[calculator(123+456)]"
answered "<579>"; `hermes`, OpenAI tools through the chat template), run (at most
`max_parallel_calls`; a malformed call, an unknown tool or a tool's failure is answered with an
error text the model reads), and their results appended as one tool turn; generation continues
from the whole conversation, up to `max_assistant_turns` turns. A turn without a call is the
final answer. Every turn of every sequence in the batch is generated together, one engine call
per turn.

Token-in/token-out: the response is exactly the tokens the engine sampled plus the tool turns'
tokens, each tool turn rendered and tokenized alone; the conversation is never re-rendered from
text. `rollout.max_response_length` bounds all of it together (verl's `response_length`). Tool
tokens carry response_mask 0: the trainer leaves them out of the loss. Their `rollout_logprobs`
were not sampled; they are filled with the policy's own log-probs of those tokens, scored by the
engine (`score_tokens`), so every per-token column stays finite and what the trainer recomputes
on them agrees with it (the agreement probe may then include them).

Environments (`rollout.multi_turn.environment`, gpu_jobs.rollout.environments): the opening
messages come from `reset(row)` (so `generate` then needs `rows=`, the prompts' dataset rows:
`generate_with_rows` passes them), and a model turn without a call is answered by `step`: its
messages are appended as their own fragment (rendered alone, tokenized alone, mask 0) unless
the episode is done, and its reward is recorded for that turn. The last model turn of every
response is stepped too, so each row gets `turn_scores` (one reward per stepped turn, the last
one final) and `turn_ends` (the index in the response of each stepped turn's last token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_jobs.rollout.base import SamplingConfig, make_row
from gpu_jobs.rollout.env_runner import FAILED, EnvironmentRunner
from gpu_jobs.chat.hermes import Call
from gpu_jobs.rollout.multi_turn_config import MultiTurnConfig
from gpu_jobs.chat.tool_worker import truncate_text
from gpu_jobs.chat.tools import ToolSet
from gpu_jobs.chat.turn_formats import TURN_FORMATS

__all__ = ["MultiTurnConfig", "AgentLoopEngine", "truncate_text", "with_agent_loop", "generate_with_rows"]

# Each turn draws with its own seed, so turn 2 does not replay turn 1's noise.
_TURN_SEED_STRIDE = 7_919


@dataclass
class _Conversation:
    """One response being built: its tokens, per-token log-probs and mask, turns so far."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    turns: int = 0
    last_turn: list[int] = field(default_factory=list)
    tool_calls: int = 0
    malformed: int = 0
    tool_errors: int = 0
    pending_calls: dict[int, tuple[str, Any]] = field(default_factory=dict)  # the last turn's calls to run
    # With an environment: its instance, the conversation as messages, a reward per stepped turn.
    env: Any = None
    messages: list[dict] | None = None
    turn_scores: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    judged: int = 0  # model turns the environment has seen
    done: bool = False
    env_errors: int = 0
    last_end: int = -1  # index of the last model token in `response`

    def add_model_turn(self, row: dict, text: str | None = None) -> None:
        self.last_turn = list(row["response_ids"])
        self.response += self.last_turn
        self.logprobs += list(row["rollout_logprobs"])
        self.mask += [1] * len(self.last_turn)
        self.finish_reason, self.turns = row["finish_reason"], self.turns + 1
        self.last_end = len(self.response) - 1
        if self.messages is not None:
            self.messages.append({"role": "assistant", "content": text or ""})

    def append_masked(self, ids: list[int]) -> None:
        """Tokens the model did not sample (a tool or environment turn): mask 0, log-probs later."""
        self.response += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def judge(self, env: Any, result: Any) -> None:
        """Record the environment's answer to the last model turn (`env` FAILED: reward 0, done)."""
        if env == FAILED:
            self.env_errors, self.done, reward = self.env_errors + 1, True, 0.0
        else:
            self.env, self.done, reward = env, bool(result.done), float(result.reward)
        self.judged = self.turns
        self.turn_scores.append(reward)
        self.turn_ends.append(self.last_end)


class AgentLoopEngine:
    """A rollout engine whose `generate` runs multi-turn conversations on an inner engine; rows
    gain `response_mask` and `num_turns`. Weight updates and everything else go to the inner one."""

    def __init__(self, engine: Any, config: MultiTurnConfig, tokenizer: Any, prompt_key: str = "prompt"):
        self.engine, self.config, self.tokenizer = engine, config, tokenizer
        self.prompt_key = prompt_key  # the rows' messages column (data.prompt_key)
        self.tools = ToolSet(config.tool_entries(), config.tool_timeout_s, config.tool_num_workers,
                             config.max_tool_response_length, config.tool_response_truncate_side)
        self.turns = TURN_FORMATS[config.format](tokenizer, self.tools)
        env = config.environment_config()  # interaction_config_path's, else environment
        self.environment = EnvironmentRunner(env, config.tool_timeout_s, config.tool_num_workers,
                                             config.max_tool_response_length,
                                             config.tool_response_truncate_side) if env.enabled else None
        self.last_metrics: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:  # update_weights_partial, close, model, ...
        if "engine" not in self.__dict__:  # half-built (copy, unpickling): no delegation yet
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)

    def update_weights(self, weights: Any) -> None:
        self.engine.update_weights(weights)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 rows: list[dict] | None = None) -> list[dict]:
        """See `RolloutEngine.generate`; each row also has response_mask (list[int]) and num_turns,
        and with an environment turn_scores and turn_ends. `rows`: the prompts' dataset rows,
        which an environment's reset needs, and whose messages (column `prompt_key`) let the
        hermes format place the tools in a prompt's own system message."""
        budget = sampling.max_response_length
        episodes = None
        messages = _prompt_messages(rows, len(prompts), self.prompt_key)
        if self.environment is not None:
            prompts, episodes, messages = self._open_episodes(prompts, rows, n)
        # hermes: the tools shown in the system turn (the prompt's own, where its messages have one)
        prompts = [self.turns.prompt(list(p), m) for p, m in zip(prompts, messages)]
        convs = []
        for k, row in enumerate(self.engine.generate(prompts, n, sampling)):
            conv = _Conversation(row["prompt_index"], row["sample_index"], list(row["prompt_ids"]))
            if episodes is not None:
                conv.env, conv.messages = episodes[k]
            conv.add_model_turn(row, self._text(row) if episodes is not None else None)
            if conv.env == FAILED:  # its reset failed: over before it began
                conv.judge(FAILED, None)
            convs.append(conv)
        for turn in range(1, self.config.max_assistant_turns):
            active, quiet = self._run_tools([c for c in convs if c.finish_reason == "stop" and not c.done], budget)
            if self.environment is not None:
                active += self._step_environment(quiet, budget)
            if not active:
                break
            seed = None if sampling.seed is None else sampling.seed + turn * _TURN_SEED_STRIDE
            contexts = [c.prompt_ids + c.response for c in active]
            # One call per distinct remaining budget would batch worse; a shared cap plus a
            # per-row cut keeps one call and the budget exact.
            cap = max(budget - len(c.response) for c in active)
            turns = self.engine.generate(contexts, 1, sampling.model_copy(update={"seed": seed, "max_response_length": cap}))
            for conv, row in zip(active, turns):
                row = _cut(row, budget - len(conv.response))
                conv.add_model_turn(row, self._text(row) if conv.messages is not None else None)
        if self.environment is not None:  # every response's last turn gets the final reward
            self._step_environment([c for c in convs if c.judged < c.turns], budget, final=True)
        self._fill_tool_logprobs(convs, sampling)
        self.last_metrics = _metrics(convs)
        return [self._row(c) for c in convs]

    def _text(self, row: dict) -> str:
        return self.tokenizer.decode(row["response_ids"], skip_special_tokens=True)

    def _open_episodes(self, prompts: list[list[int]], rows: list[dict] | None,
                       n: int) -> tuple[list[list[int]], list[tuple[Any, list[dict]]], list[list[dict]]]:
        """The environment's opening of each prompt's episode: (prompt ids rendered from reset's
        messages, (environment, messages) per response, prompt-major, each prompt's messages); a
        failed reset keeps the given prompt (and the row's messages) and marks its episodes FAILED."""
        from gpu_jobs.data.rendering import normalize_messages, render_prompt

        if rows is None or len(rows) != len(prompts):
            raise ValueError("rollout.multi_turn.environment: generate needs the prompts' dataset rows (rows=...), "
                             "which the environment's reset reads")
        # reset sees the messages as `prompt` (the environment protocol), whatever data.prompt_key is
        given = [{**r, "prompt": normalize_messages(r.get(self.prompt_key))} for r in rows]
        opened = self.environment.reset(given)
        ids, episodes, opening = [], [], []
        for p, row, (env, messages) in zip(prompts, given, opened):
            failed = env == FAILED
            ids.append(list(p) if failed else render_prompt(messages, self.tokenizer))
            opening.append(row["prompt"] if failed else messages)
            copies = [FAILED] * n if failed else EnvironmentRunner.copies(env, n)
            episodes += [(e, [] if failed else [dict(m) for m in messages]) for e in copies]
        return ids, episodes, opening

    def _step_environment(self, convs: list[_Conversation], budget: int, final: bool = False) -> list[_Conversation]:
        """Step the environment of each conversation after its last model turn; append its
        messages where the episode goes on and they fit with room for a model turn after them
        (else the response ends here). Returns the conversations that continue."""
        results = self.environment.step([(c.env, c.messages) for c in convs])
        active = []
        for conv, (env, result) in zip(convs, results):
            conv.judge(env, result)
            if final or conv.done:
                continue
            ids = self.turns.message_ids(result.messages)
            if len(ids) >= budget - len(conv.response):
                conv.finish_reason = "length"
                continue
            conv.append_masked(ids)
            conv.messages += result.messages
            active.append(conv)
        return active

    def _run_tools(self, convs: list[_Conversation], budget: int) -> tuple[list[_Conversation], list[_Conversation]]:
        """Run the calls in the last turns of `convs`, append their results as tool turns; returns
        the conversations that continue (a call and room left after its results) and those whose
        last turn made no call."""
        answered = [(c, self._answers(c)) for c in convs]
        quiet = [c for c, texts in answered if not texts]
        answered = [(c, texts) for c, texts in answered if texts]
        pending = [(c, texts, j) for c, texts in answered for j, t in enumerate(texts) if t is None]
        results = self.tools.run([conv.pending_calls[j] for conv, _, j in pending])
        for (conv, texts, j), text in zip(pending, results):
            texts[j] = text
            conv.tool_errors += text.startswith("error:")
        active = []
        for conv, texts in answered:
            ids = self.turns.result_ids(texts)
            room = budget - len(conv.response)
            conv.append_masked(ids[:room])
            if conv.messages is not None:
                conv.messages += [{"role": "tool", "content": t} for t in texts]
            if len(ids) >= room:  # no room left for the model to answer
                conv.finish_reason = "length"
            else:
                active.append(conv)
        return active, quiet

    def _answers(self, conv: _Conversation) -> list[str | None]:
        """One slot per call of the conversation's last turn: an error text already (malformed, or
        past max_parallel_calls) or None, a call to run (kept in conv.pending_calls)."""
        calls = self.turns.parse(self.tokenizer.decode(conv.last_turn, skip_special_tokens=True))
        limit, cut = self.config.max_parallel_calls, self.config.max_tool_response_length
        conv.tool_calls += len(calls)
        conv.pending_calls = {}
        out: list[str | None] = []
        for j, call in enumerate(calls):
            if j >= limit:
                out.append(f"error: at most {limit} tool call(s) per turn; this one was not run")
            elif isinstance(call, Call):
                conv.pending_calls[j] = (call.name, call.arguments)
                out.append(None)
            else:
                conv.malformed += 1
                out.append(truncate_text(call.message, cut, self.config.tool_response_truncate_side))
        return out

    def _fill_tool_logprobs(self, convs: list[_Conversation], sampling: SamplingConfig) -> None:
        """Tool tokens get the policy's log-probs of them (at the sampling temperature)."""
        with_tools = [c for c in convs if 0 in c.mask]
        if not with_tools:
            return
        scores = self.engine.score_tokens([c.prompt_ids + c.response for c in with_tools], sampling.temperature)
        for conv, lp in zip(with_tools, scores):
            start = len(conv.prompt_ids) - 1  # lp[i] is the log-prob of token i + 1
            conv.logprobs = [conv.logprobs[j] if m else float(lp[start + j]) for j, m in enumerate(conv.mask)]

    @staticmethod
    def _row(conv: _Conversation) -> dict:
        row = make_row(conv.prompt_index, conv.sample_index, conv.prompt_ids, conv.response, conv.logprobs,
                       conv.finish_reason)
        row.update(response_mask=[int(m) for m in conv.mask], num_turns=conv.turns)
        if conv.messages is not None:
            row.update(turn_scores=list(conv.turn_scores), turn_ends=list(conv.turn_ends))
        return row


def _cut(row: dict, room: int) -> dict:
    """A turn cut to the `room` tokens its conversation has left (finish_reason then "length")."""
    if len(row["response_ids"]) <= room:
        return row
    return {**row, "response_ids": row["response_ids"][:room], "rollout_logprobs": row["rollout_logprobs"][:room],
            "finish_reason": "length"}


def _metrics(convs: list[_Conversation]) -> dict[str, float]:
    """verl's multi-turn metrics of one generate call."""
    if not convs:
        return {}
    turns = [c.turns for c in convs]
    calls = [c.tool_calls for c in convs]
    malformed = sum(c.malformed for c in convs)
    out = _environment_metrics(convs) if convs[0].messages is not None else {}
    return {**out, "multi_turn/malformed_calls": float(malformed),
            "multi_turn/malformed_call_frac": malformed / max(1, sum(calls)),
            "multi_turn/tool_errors": float(sum(c.tool_errors for c in convs)),
            "multi_turn/num_turns/mean": sum(turns) / len(turns), "multi_turn/num_turns/max": float(max(turns)),
            "multi_turn/tool_calls/mean": sum(calls) / len(calls),
            "multi_turn/tool_call_frac": sum(1 for c in calls if c) / len(calls)}


def _environment_metrics(convs: list[_Conversation]) -> dict[str, float]:
    """The environment's rewards: final (the score it gives), per stepped turn, and its failures."""
    finals = [c.turn_scores[-1] for c in convs if c.turn_scores]
    turns = [r for c in convs for r in c.turn_scores]
    return {"multi_turn/env_final_reward/mean": sum(finals) / max(1, len(finals)),
            "multi_turn/env_turn_reward/mean": sum(turns) / max(1, len(turns)),
            "multi_turn/env_steps/mean": len(turns) / len(convs),
            "multi_turn/env_errors": float(sum(c.env_errors for c in convs))}


def _prompt_messages(rows: list[dict] | None, count: int, key: str = "prompt") -> list[list[dict] | None]:
    """Each prompt's messages (its row's `key` column), None per prompt where the rows are not given."""
    from gpu_jobs.data.rendering import normalize_messages

    if rows is None or len(rows) != count:
        return [None] * count
    return [normalize_messages(r.get(key)) if key in r else None for r in rows]


def generate_with_rows(engine: Any, prompts: list[dict], ids: list[list[int]], n: int,
                       sampling: SamplingConfig) -> list[dict]:
    """`engine.generate(ids, n, sampling)`, handing an agent loop the prompts' dataset rows too
    (an environment's reset reads them; the hermes format places the tools in a prompt's own
    system message); every stage that samples calls this."""
    if isinstance(engine, AgentLoopEngine):
        return engine.generate([list(x) for x in ids], n, sampling, rows=list(prompts))
    return engine.generate([list(x) for x in ids], n, sampling)


def with_agent_loop(engine: Any, config: MultiTurnConfig, tokenizer: Any, prompt_key: str = "prompt") -> Any:
    """`engine` wrapped in an AgentLoopEngine when `config.enable` (once: a wrapped engine is
    returned as is), else `engine` unchanged; `prompt_key`: the rows' messages column."""
    if not config.enable or isinstance(engine, AgentLoopEngine) or engine is None:
        return engine
    return AgentLoopEngine(engine, config, tokenizer, prompt_key)
