"""How the built-in models are built and cached: one recipe digest, one cache folder per digest,
one builder at a time, and one supervised loop for the three warm-ups (the built-in policy in
tiny.py, the tool model in tool_model.py, the reward model in reward_model.py).

    root = default_cache_dir()                                   # ~/.cache/rlmill/models
    path = build_once(root / f"builtin-{recipe_digest(recipe)}", lambda tmp: build_into(tmp))
    with one_thread_seeded(recipe.seed):
        for step, loss in supervised_steps(model, next_loss, lr=1e-3, weight_decay=0.01, max_steps=4000):
            ...                                                  # check a measured quantity; return when reached

The loop only takes optimizer steps; what each warm-up measures and when it stops stays with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["default_cache_dir", "recipe_digest", "build_once", "one_thread_seeded", "supervised_steps"]


def default_cache_dir() -> Path:
    """~/.cache/rlmill/models, or $RLMILL_CACHE_DIR/models."""
    root = os.environ.get("RLMILL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "rlmill")
    return Path(root) / "models"


def recipe_digest(recipe) -> str:
    """12 hex digits naming a built model's recipe (a dataclass): the cache folder's suffix, so a
    changed field builds anew. The three built-in models' recipes all name themselves this way."""
    return hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode()).hexdigest()[:12]


PROGRESS_EVERY_S = 10.0  # a build is never silent for longer (it can take minutes)


def _progress_lines(name: str, usually_s: float | None, done: threading.Event, doing: str = "building") -> None:
    """Every PROGRESS_EVERY_S until `done`: how long the build has run (or this process has
    waited for another's) and, against `usually_s` (its time alone on 2 cores), about how long is
    left."""
    t0 = time.perf_counter()
    while not done.wait(PROGRESS_EVERY_S):
        elapsed = time.perf_counter() - t0
        if usually_s is None:
            estimate = ""
        elif elapsed < usually_s:
            estimate = f", about {usually_s - elapsed:.0f} s left (usually ~{usually_s:.0f} s on 2 idle cores)"
        else:
            estimate = f", longer than the usual ~{usually_s:.0f} s on 2 idle cores (a busy machine)"
        print(f"rlmill: still {doing} {name}: {elapsed:.0f} s so far{estimate}", file=sys.stderr, flush=True)


def build_once(final: Path, build: Callable[[Path], None], usually_s: float | None = None) -> str:
    """The cached model folder `final`, built by `build(tmp)` into a temp sibling and renamed
    into place the first time: a crash never leaves a half-written model. Builders of the same
    folder take turns on `<final>.lock` (flock: released by the kernel when a builder dies), so a
    second process (another test worker, a second `rlmill train`) waits for the first build
    instead of repeating it. The first build says on stderr what it builds, how long it usually
    takes (`usually_s`, measured alone on 2 cores), and every PROGRESS_EVERY_S how far it is."""
    import fcntl

    if (final / "config.json").exists():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds it: wait, and say so
            print(f"rlmill: waiting for another process that builds {final.name}", file=sys.stderr, flush=True)
            waited = threading.Event()
            threading.Thread(target=_progress_lines, args=(final.name, usually_s, waited, "waiting for"),
                             daemon=True).start()
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            finally:
                waited.set()
        try:
            if (final / "config.json").exists():  # built while this process waited
                return str(final)
            usually = f", usually ~{usually_s:.0f} s" if usually_s else ""
            print(f"rlmill: building {final.name} into {final.parent} (first use on this machine{usually}; "
                  "cached for every later run)", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
            done = threading.Event()
            threading.Thread(target=_progress_lines, args=(final.name, usually_s, done), daemon=True).start()
            try:
                build(tmp)
                try:
                    os.rename(tmp, final)
                except OSError:  # a builder that took a lock file removed meanwhile finished first
                    if not (final / "config.json").exists():
                        raise
            finally:
                done.set()
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"rlmill: built {final.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        finally:
            lock_path.unlink(missing_ok=True)  # the cache holds models only; a waiter re-checks above
    return str(final)


@contextmanager
def one_thread_seeded(seed: int) -> Iterator[None]:
    """One torch thread under a forked torch RNG seeded with `seed`; the caller's thread count and
    RNG come back afterwards. On one machine a build then depends only on its recipe (the thread
    count changes the float reduction order); across machines the step counts move, the measured
    quantities every warm-up stops on do not."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)


def supervised_steps(model, next_loss: Callable[[], object], *, lr: float, weight_decay: float,
                     max_steps: int, warmup_steps: int = 0) -> Iterator[tuple[int, float]]:
    """AdamW steps on `next_loss()` (the loss of the next batch, drawn by the caller) with the
    gradient norm clipped at 1.0 and, when `warmup_steps` > 0, a linear lr warm-up over that many
    steps; yields (step, loss) after each step, step counting from 1, until `max_steps`. The model
    is in train mode while the loop runs; stopping is the caller's (leave the loop)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup_steps))
             if warmup_steps > 0 else None)
    model.train()
    for step in range(1, max_steps + 1):
        loss = next_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        yield step, float(loss.detach())


def save_dequantized(model, tok, out) -> None:
    """Save a model read from a GGUF file (weights dequantized on load) and its tokenizer as a plain
    HF folder `out`: a leftover quantizer refuses to save, and a leftover quantization_config would
    make from_pretrained / vLLM look for a GGUF quantizer when reading the plain folder."""
    from pathlib import Path

    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    cfg_path = Path(out) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
