"""The built-in arithmetic reward model: a Qwen2 sequence classifier that scores "a+b=" + answer.

    python -c "from gpu_jobs.models.reward_model import ensure_arith_reward_model as f; print(f())"

It makes model-based reward testable offline (`reward_model.model.path: builtin`). Like a real
reward model it starts from the policy's own weights (the built-in tiny model's backbone, as
InstructGPT's reward models start from the SFT model) with a fresh one-logit head, and learns
from labelled responses: answers the built-in policy samples to training problems (labelled
right or wrong by the arithmetic rule) plus the right answer and a near miss (off by 1, 9, 10,
11 or 100) for each problem. The score is a logit (> 0: "right"), trained with binary
cross-entropy on batches half right, half wrong.

It is a weak judge, and that is measured, not hidden: the policy's wrong answers are near
misses (mostly a wrong last digit), and telling them apart means redoing the addition. On
held-out problems its AUC (the chance that a right answer outscores a wrong one) reaches
~0.55-0.57 within a few hundred steps and stays there (3000 steps did not lift it past 0.57;
neither did a third layer or a reversed layout, measured 2026-12-01). Training stops at the
first check where that probe AUC reaches `target_auc`, a measured quantity rather than a step
count, as for the built-in policy. Built once and cached next to the built-in model
(`<cache>/arith-rm-<hash>`); a real reward model is any HF sequence-classification folder.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpu_jobs.models.build import build_once, default_cache_dir, one_thread_seeded, recipe_digest, supervised_steps
from gpu_jobs.models.tiny import ensure_builtin_model, probe_problems, training_stream
from gpu_jobs.models.tokenizer import build_tokenizer

__all__ = ["RewardModelRecipe", "ensure_arith_reward_model", "resolve_reward_model_path", "labelled_answers",
           "RM_CHAT_TEMPLATE", "RewardModelNotReachedError", "auc", "rm_auc"]

# Bump when the recipe changes in a way the fields below do not capture (part of the cache key).
RM_RECIPE_VERSION = 1

# The policy's template renders user turns only; a reward model must see the assistant's answer
# too, so its tokenizer renders every turn's content, in order ("37+45=" + "82").
RM_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

NEAR_MISSES = (1, -1, 9, -9, 10, -10, 11, -11, 100, -100)


# Seconds a first build takes alone on 2 idle cores (measured 2026-12-01); build_once's progress
# lines estimate what is left against it.
BUILD_USUALLY_S = 23.0


class RewardModelNotReachedError(RuntimeError):
    """Training hit `max_steps` before the probe AUC reached `target_auc`."""


@dataclass(frozen=True)
class RewardModelRecipe:
    """How the built-in reward model is made; its hash (with the policy's) names the cache folder."""

    seed: int = 0
    policy_seed: int = 0  # the built-in policy whose backbone it starts from
    problems: int = 4096  # training problems; each gets `samples` policy answers + right + near miss
    samples: int = 4
    batch_size: int = 64
    lr: float = 1e-3
    check_every: int = 50
    probe_size: int = 256
    # Measured: the probe AUC climbs to ~0.55-0.57 within a few hundred steps and then wanders
    # there (3000 steps: 0.53-0.56), so the first check at 0.56 is where it is kept.
    target_auc: float = 0.56
    max_steps: int = 3000  # a safety cap, not a tuning knob
    version: int = RM_RECIPE_VERSION

    def digest(self) -> str:
        return recipe_digest(self)


def resolve_reward_model_path(path: str, storage=None) -> str:
    """A local folder for `reward_model.model.path`: 'builtin' is built/cached here; anything
    else goes through the policy's resolver (local folder, file://, storage URL)."""
    if path == "builtin":
        return ensure_arith_reward_model()
    from gpu_jobs.models.loading import resolve_model_path

    return resolve_model_path(path, storage)


def ensure_arith_reward_model(cache_dir=None, recipe: RewardModelRecipe | None = None) -> str:
    """Path of the built-in reward model's HF folder, building it on first use (the built-in
    policy first if it is not cached; then ~80 s on 2 busy cores: sampling 16k answers and
    ~200 training steps, measured 2026-12-01)."""
    recipe = recipe or RewardModelRecipe()
    policy = ensure_builtin_model(cache_dir, seed=recipe.policy_seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / reward_model_folder(Path(policy).name, recipe), lambda tmp: _build_into(tmp, policy, recipe),
                      BUILD_USUALLY_S)


def reward_model_folder(policy_folder: str, recipe: RewardModelRecipe) -> str:
    """The cache folder's name: its recipe and the policy it starts from (by its folder name)."""
    return f"arith-rm-{hashlib.sha256(f'{recipe.digest()}:{policy_folder}'.encode()).hexdigest()[:12]}"


def labelled_answers(policy, tok, problems: list[tuple[str, str]], samples: int, seed: int) -> list[tuple[str, float]]:
    """(prompt + answer, 1.0 if right else 0.0) for each problem: `samples` answers sampled from
    `policy` at temperature 1 (labelled by the arithmetic rule), the right answer, and a near
    miss. Deterministic in `seed` (forked torch RNG)."""
    import torch

    from gpu_jobs.reward.rules import arith_score

    rng = random.Random(seed)
    out: list[tuple[str, float]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(problems), 256):
            chunk = problems[start:start + 256]
            answers = _sample(policy, tok, [p for p, _ in chunk], samples)
            for j, (prompt, truth) in enumerate(chunk):
                for ans in answers[j * samples:(j + 1) * samples]:
                    out.append((prompt + ans, arith_score(ans, truth)))
                out.append((prompt + truth, 1.0))
                out.append((prompt + str(int(truth) + rng.choice(NEAR_MISSES)), 0.0))
    return out


def _sample(policy, tok, prompts: list[str], samples: int) -> list[str]:
    """`samples` decoded answers per prompt (prompt-major), temperature 1, at most 6 tokens."""
    import torch

    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(samples)]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, x in enumerate(ids):  # left padding, as generation expects
        input_ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    with torch.inference_mode():
        out = policy.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                              max_new_tokens=6, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, width:], skip_special_tokens=True)


def rm_auc(model, tok, data: list[tuple[str, float]], batch_size: int = 512) -> float:
    """Probability that a right answer outscores a wrong one (ROC AUC of the logit; ties count
    half): how well the reward model separates the classes, independent of any threshold."""
    import torch

    was_training = model.training
    model.eval()
    scores: list[float] = []
    try:
        with torch.inference_mode():
            for start in range(0, len(data), batch_size):
                scores += _logits(model, tok, [t for t, _ in data[start:start + batch_size]]).tolist()
    finally:
        model.train(was_training)
    return auc(scores, [y for _, y in data])


def auc(scores: list[float], labels: list[float]) -> float:
    """ROC AUC of `scores` for binary `labels` (1 = positive): the share of (positive,
    negative) pairs the positive wins, ties counted half; 0.5 when a class is empty.
    Pairwise (n_pos x n_neg floats): fine for the few thousand rows of a probe."""
    import numpy as np

    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    pos, neg = s[y][:, None], s[~y][None, :]
    if not pos.size or not neg.size:
        return 0.5
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def _logits(model, tok, texts: list[str]):
    """(batch,) logits; right padding, so HF's classifier reads the last real token."""
    enc = tok(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    return model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0]


def train_reward_model(model, tok, train: list[tuple[str, float]], probe: list[tuple[str, float]],
                       recipe: RewardModelRecipe) -> list[tuple[int, float]]:
    """Binary cross-entropy on the logit, balanced batches, until the probe AUC reaches
    recipe.target_auc; returns the (step, AUC) checks. One thread, forked RNG."""
    import torch

    order = random.Random(recipe.seed)
    # Balanced batches: the policy is right ~30% of the time, and cross-entropy on the raw mix
    # first learns only that prior.
    pos, neg = [x for x in train if x[1] > 0.5], [x for x in train if x[1] <= 0.5]
    half = recipe.batch_size // 2

    def next_loss():
        batch = order.sample(pos, half) + order.sample(neg, recipe.batch_size - half)
        target = torch.tensor([y for _, y in batch])
        return torch.nn.functional.binary_cross_entropy_with_logits(_logits(model, tok, [t for t, _ in batch]), target)

    checks: list[tuple[int, float]] = []
    with one_thread_seeded(recipe.seed):
        for step, _ in supervised_steps(model, next_loss, lr=recipe.lr, weight_decay=0.0, max_steps=recipe.max_steps):
            if step % recipe.check_every == 0:
                checks.append((step, rm_auc(model, tok, probe)))
                if checks[-1][1] >= recipe.target_auc:
                    model.eval()
                    return checks
    raise RewardModelNotReachedError(
        f"built-in reward model: probe AUC never reached {recipe.target_auc} in "
        f"{recipe.max_steps} steps (last checks {checks[-5:]}); report it with these checks")


def rm_tokenizer():
    """The character tokenizer, right-padded, with a template that keeps the assistant's turn."""
    tok = build_tokenizer()
    tok.padding_side = "right"
    tok.chat_template = RM_CHAT_TEMPLATE
    return tok


def _build_into(folder: Path, policy_path: str, recipe: RewardModelRecipe) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2ForSequenceClassification

    t0 = time.perf_counter()
    tok = rm_tokenizer()
    gen_tok = build_tokenizer()  # left padding for sampling
    policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    probe_pairs = probe_problems(recipe.probe_size, seed=30_000 + recipe.seed)
    stream = training_stream(40_000 + recipe.seed, exclude={p for p, _ in probe_pairs})
    train_pairs = [next(stream) for _ in range(recipe.problems)]
    train = labelled_answers(policy, gen_tok, train_pairs, recipe.samples, seed=recipe.seed)
    probe = labelled_answers(policy, gen_tok, probe_pairs, recipe.samples, seed=recipe.seed + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)  # the new score head's init
        model = Qwen2ForSequenceClassification.from_pretrained(policy_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    checks = train_reward_model(model, tok, train, probe, recipe)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    info = {"recipe": asdict(recipe), "policy": policy_path, "checks": checks, "probe_auc": checks[-1][1],
            "train_rows": len(train), "train_right_frac": sum(y for _, y in train) / len(train),
            "build_seconds": round(time.perf_counter() - t0, 1)}
    (folder / "rlmill_recipe.json").write_text(json.dumps(info, indent=2))
