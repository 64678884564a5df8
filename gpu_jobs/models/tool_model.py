"""The built-in tool model: the built-in tiny model taught to call the calculator.

    python -m gpu_jobs.models.tool_model        # builds once (cached), prints the HF folder

The built-in model adds 2-digit numbers and has never seen a tool call. This short supervised
warm-up teaches it the call format on 3-digit additions (the `arith_tools` task):

    prompt "123+456="   model "[calculator(123+456)]<eos>"   tool "<579>"   model "579<eos>"

with the loss on the model's tokens only (the tool's answer is context, as in RL). Training
stops on a measured quantity, never a step count: at the first check where greedy exact match
*with the calculator* on a fixed probe of held-out problems reaches `target_acc` (30%: the
model always calls the tool but often miscopies a digit, which leaves RL something to raise;
the built-in model alone adds none of these). Measured on one busy 2-core machine: 1860
steps, ~5 min of one core; the accuracy climbs slowly past that (~25-31% from step 1700 to
2700), so 50% would cost far longer. The folder is cached like the built-in model's
(`<cache>/builtin-tools-<recipe hash>`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpu_jobs.models.build import build_once, default_cache_dir, one_thread_seeded, recipe_digest, supervised_steps
from gpu_jobs.models.tiny import ensure_builtin_model
from gpu_jobs.data.tool_calls import calculator, get_tool_format

__all__ = ["ToolRecipe", "ensure_tool_model", "tool_exact_match", "tool_problems", "ToolWarmupNotReachedError"]

log = logging.getLogger("rlmill")
RECIPE_VERSION = 1
FORMAT = "brackets"


# Seconds a first build takes alone on 2 idle cores (measured 2026-12-01); build_once's progress
# lines estimate what is left against it.
BUILD_USUALLY_S = 93.0


class ToolWarmupNotReachedError(RuntimeError):
    """The warm-up hit max_steps before the probe accuracy with tools reached target_acc."""


@dataclass(frozen=True)
class ToolRecipe:
    """How the tool model is made; its hash names the cache folder."""

    base_seed: int = 0  # the built-in model it starts from
    seed: int = 0
    batch_size: int = 32
    lr: float = 1e-3
    target_acc: float = 0.3
    probe_size: int = 128
    check_every: int = 20
    max_steps: int = 4000  # a safety cap, not a tuning knob
    version: int = RECIPE_VERSION

    def digest(self) -> str:
        return recipe_digest(self)


def tool_problems(n: int, seed: int, exclude: frozenset = frozenset()) -> list[tuple[str, str]]:
    """`n` distinct problems ("a+b=", str(a+b)), a and b in 100..999, not in `exclude`."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if f"{a}+{b}=" not in seen:
            seen.add(f"{a}+{b}=")
            out.append((f"{a}+{b}=", str(a + b)))
    return out


def _segments(tok, prompt: str, answer: str) -> list[tuple[list[int], bool]]:
    """(token ids, trained on?) of one solved problem: prompt, call + EOS, tool turn, answer + EOS."""
    fmt = get_tool_format(FORMAT)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    expr = prompt.rstrip("=")
    return [(enc(prompt), False), (enc(f"[calculator({expr})]") + [tok.eos_token_id], True),
            (enc(fmt.render_response(calculator(expr))), False), (enc(answer) + [tok.eos_token_id], True)]


def _batch(tok, problems):
    """Left-padded (input_ids, attention_mask, labels, position_ids), each (batch, seq); labels
    are -100 on the prompt and the tool turn."""
    import torch

    seqs = []
    for p, a in problems:
        ids, labels = [], []
        for part, trained in _segments(tok, p, a):
            ids += part
            labels += part if trained else [-100] * len(part)
        seqs.append((ids, labels))
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(seqs):
        ids[i, width - len(s):], labels[i, width - len(s):] = torch.tensor(s), torch.tensor(lab)
        mask[i, width - len(s):] = 1
    return ids, mask, labels, (mask.cumsum(-1) - 1).clamp(min=0)


def _greedy(model, tok, contexts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuation of each context until EOS (EOS kept) or max_new tokens."""
    import torch

    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):], mask[i, width - len(c):] = torch.tensor(c), 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    rows = []
    for row in out[:, width:].tolist():
        cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        rows.append(row[:cut])
    return rows


def tool_exact_match(model, tok, problems, use_tools: bool = True) -> float:
    """Greedy exact match of the final answer: with tools, a turn that calls the calculator gets
    its answer and one more turn (the agent loop's rule, two turns); without, the first turn is
    the answer. The warm-up's stopping check and the tests'; the flow scores with its reward."""
    fmt = get_tool_format(FORMAT)
    was_training = model.training
    model.eval()
    try:
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in problems]
        first = _greedy(model, tok, prompts, 24)
        texts = [tok.decode(t, skip_special_tokens=True) for t in first]
        if use_tools:
            calls = [fmt.parse_call(t) for t in texts]
            todo = [i for i, c in enumerate(calls) if c is not None and c[0] == "calculator"]
            if todo:
                tool = [tok(fmt.render_response(calculator(calls[i][1])), add_special_tokens=False)["input_ids"]
                        for i in todo]
                second = _greedy(model, tok, [prompts[i] + first[i] + t for i, t in zip(todo, tool)], 8)
                for i, t, s in zip(todo, tool, second):
                    texts[i] = tok.decode(first[i] + t + s, skip_special_tokens=True)
        return sum(fmt.final_answer(t).strip() == a for t, (_, a) in zip(texts, problems)) / len(problems)
    finally:
        model.train(was_training)


def warmup_tools(model, tok, recipe: ToolRecipe) -> dict:
    """Train `model` in place until the probe accuracy with tools reaches target_acc; returns
    what it did (steps, checks). One thread under a forked RNG, as the built-in warm-up."""
    with one_thread_seeded(recipe.seed):
        probe = tool_problems(recipe.probe_size, seed=30_000 + recipe.seed)
        stream = random.Random(40_000 + recipe.seed)
        exclude = frozenset(p for p, _ in probe)

        def next_loss():
            batch = tool_problems(recipe.batch_size, stream.randrange(1 << 30), exclude)
            ids, mask, labels, positions = _batch(tok, batch)
            return model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss

        checks = []
        for step, loss in supervised_steps(model, next_loss, lr=recipe.lr, weight_decay=0.01,
                                           max_steps=recipe.max_steps):
            if step % recipe.check_every:
                continue
            checks.append((step, tool_exact_match(model, tok, probe), loss))
            log.info("tool warm-up step %d: probe exact match with the calculator %.3f, loss %.3f", *checks[-1])
            if checks[-1][1] >= recipe.target_acc:
                model.eval()
                return {"steps": step, "probe_acc": checks[-1][1], "checks": checks}
    raise ToolWarmupNotReachedError(f"tool warm-up: probe exact match with the calculator never reached "
                                    f"{recipe.target_acc} in {recipe.max_steps} steps (last checks {checks[-5:]})")


def ensure_tool_model(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """Path of the tool model's HF folder, built on first use from the built-in model (itself
    built first if needed) and cached."""
    recipe = ToolRecipe(base_seed=seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / f"builtin-tools-{recipe.digest()}", lambda tmp: _build_into(tmp, recipe, cache_dir),
                      BUILD_USUALLY_S)


def _build_into(folder: Path, recipe: ToolRecipe, cache_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = ensure_builtin_model(cache_dir, seed=recipe.base_seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    tok = AutoTokenizer.from_pretrained(base)
    t0 = time.perf_counter()
    info = warmup_tools(model, tok, recipe)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    info.update(recipe=asdict(recipe), base=str(base), warmup_seconds=round(time.perf_counter() - t0, 1))
    (folder / "rlmill_recipe.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    print(ensure_tool_model())
