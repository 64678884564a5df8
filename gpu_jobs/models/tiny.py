"""The built-in tiny model: a ~0.5M-parameter Qwen2 that half-knows 2-digit addition.

    python -c "from gpu_jobs.models import ensure_builtin_model; print(ensure_builtin_model())"

`ensure_builtin_model()` builds it once (random init from a seed, then a short supervised
warm-up on "a+b=" -> "c<eos>") and caches the HF folder on disk. The warm-up stops at a fixed
step count chosen so that greedy exact match on held-out problems lands around 25-45%: RL then
has visible room to improve, and a run of it takes well under a minute of one CPU core.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from gpu_jobs.models.tokenizer import build_tokenizer, char_vocab

# Bump when the recipe changes in a way the fields below do not capture: it is part of the
# cache key, so old cached models are never reused for a new recipe.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class WarmupRecipe:
    """How the built-in model is made; its hash names the cache folder."""

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 2
    # Tuned on seed 0: exact match jumps from ~10% to ~65% between steps 800 and 950 (the
    # model "gets" carries); 900 steps lands at ~35%. Other seeds cross at other steps.
    steps: int = 900
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    version: int = RECIPE_VERSION

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def arith_problems(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` problems ("a+b=", str(a+b)) with a, b uniform in 10..99; deterministic in `seed`.

    Uses its own `random.Random`, so it neither reads nor disturbs global RNG state.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def build_tiny_model(seed: int = 0, hidden_size: int = 128, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                     max_position_embeddings: int = 512, dtype=None):
    """A randomly initialised Qwen2ForCausalLM over the character tokenizer.

    Deterministic from `seed`: the init runs under a forked torch RNG seeded with it, so the
    caller's global RNG is untouched. head_dim = hidden_size / num_heads (32 by default, a size
    vLLM's CPU attention supports). Returns (model in eval mode, tokenizer).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(char_vocab()),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model.eval(), tok


def _encode_batch(tok, problems):
    """Left-padded (input_ids, attention_mask, labels, position_ids), each (batch, seq).

    labels are -100 except on the answer tokens and the final EOS, so the loss teaches the
    answer only; position_ids count real tokens, as generation does with left padding.
    """
    import torch

    seqs, label_seqs = [], []
    for prompt, answer in problems:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        label_seqs.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, label_seqs)):
        ids[i, width - len(s):] = torch.tensor(s)
        labels[i, width - len(s):] = torch.tensor(lab)
        mask[i, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, labels, positions


def warmup(model, tok, recipe: WarmupRecipe) -> list[float]:
    """Supervised warm-up on freshly sampled addition problems; returns the loss per step.

    Runs on one thread under a forked RNG so the result depends only on the recipe (thread
    count changes float reduction order, which over hundreds of steps changes the model).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            return _train_steps(model, tok, recipe)
    finally:
        torch.set_num_threads(threads)


def _train_steps(model, tok, recipe: WarmupRecipe) -> list[float]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / recipe.warmup_steps)
    )
    # A training stream disjoint by seed from the held-out problems the tests evaluate on.
    problems = arith_problems(recipe.steps * recipe.batch_size, seed=10_000 + recipe.seed)
    model.train()
    losses = []
    for step in range(recipe.steps):
        batch = problems[step * recipe.batch_size:(step + 1) * recipe.batch_size]
        ids, mask, labels, positions = _encode_batch(tok, batch)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(out.loss.detach()))
    model.eval()
    return losses


def greedy_exact_match(model, tok, problems, batch_size: int = 256) -> float:
    """Fraction of problems whose greedy answer equals the ground truth (a warm-up check).

    Not the flow's evaluation: it exists so the warm-up can be tuned and tested on its own.
    """
    from gpu_jobs.rollout.base import SamplingConfig
    from gpu_jobs.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(model, tok)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in problems]
    rows = engine.generate(prompts, n=1, sampling=SamplingConfig(temperature=0.0, max_response_length=6))
    hits = 0
    for row, (_, answer) in zip(rows, problems):
        text = tok.decode(row["response_ids"], skip_special_tokens=True).strip()
        hits += text == answer
    return hits / len(problems)


def default_cache_dir() -> Path:
    """~/.cache/rlmill/models, or $RLMILL_CACHE_DIR/models."""
    root = os.environ.get("RLMILL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "rlmill")
    return Path(root) / "models"


def ensure_builtin_model(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """Path of the warmed-up built-in model's HF folder, building it on first use (~30 s).

    The folder is `<cache_dir>/builtin-<recipe hash>`; it is built in a temporary sibling and
    renamed into place, so a crash never leaves a half-written model and two concurrent
    builders simply race to the same (identical) result.
    """
    recipe = WarmupRecipe(seed=seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / f"builtin-{recipe.digest()}", lambda tmp: _build_into(tmp, recipe))


def build_once(final: Path, build: Callable[[Path], None]) -> str:
    """The cached model folder `final`, built by `build(tmp)` into a temp sibling and renamed
    into place the first time: a crash never leaves a half-written model, and two concurrent
    builders race to the same (identical) result."""
    if (final / "config.json").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: theirs is identical
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _build_into(folder: Path, recipe: WarmupRecipe) -> None:
    model, tok = build_tiny_model(recipe.seed, recipe.hidden_size, recipe.num_layers)
    t0 = time.perf_counter()
    losses = warmup(model, tok, recipe)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    info = {"recipe": asdict(recipe), "final_loss": losses[-1],
            "warmup_seconds": round(time.perf_counter() - t0, 1)}
    (folder / "rlmill_recipe.json").write_text(json.dumps(info, indent=2))
