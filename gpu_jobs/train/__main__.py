"""The policy-update job: read a committed batch and a policy checkpoint, update, write the result.

    python -m gpu_jobs.train --batch URL --checkpoint URL --out URL --config FILE.yaml
    torchrun --nproc_per_node 2 -m gpu_jobs.train --batch ... --checkpoint ... --out ... --config ...
    python -m gpu_jobs.train --print-config > trainer.yaml     # every field with its default

--batch: a committed sample table (manifest URI or its folder) with advantages.
--checkpoint: the policy as an HF folder or storage URL. --resume: a URL given to an earlier
--out (restores optimizer, step, RNG). Rank 0 writes <out>/policy (HF safetensors) and all ranks
<out>/trainer (exact-resume state), then rank 0 prints the metrics as one JSON line on stdout.
On failure every rank prints one line on stderr and the exit status is 1 (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpu_jobs.train", description=__doc__.split("\n")[0])
    p.add_argument("--batch", help="committed sample table: manifest URI or folder")
    p.add_argument("--checkpoint", help="policy to start from: HF folder or storage URL")
    p.add_argument("--out", help="where to write <out>/policy and <out>/trainer")
    p.add_argument("--config", help="ActorConfig as YAML (missing fields take their defaults)")
    p.add_argument("--resume", help="an earlier --out whose trainer state to restore first")
    p.add_argument("--print-config", action="store_true", help="print the default config as YAML")
    return p


def load_config(path: str | None) -> Any:
    """ActorConfig from a YAML file (None: defaults)."""
    import yaml

    from .config import ActorConfig

    if path is None:
        return ActorConfig()
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return ActorConfig(**data)


def run(args: argparse.Namespace) -> dict[str, float]:
    """The job body: returns the metrics (on every rank)."""
    from transformers import AutoConfig

    from storage import join, read_table

    from .batch import read_rows
    from gpu_jobs.models import resolve_model_path
    from .policy import PolicyTrainer, required_columns

    config = load_config(args.config)
    model_path = resolve_model_path(args.checkpoint)
    batch = read_table(args.batch)
    # Fail in seconds on a bad batch, before DeepSpeed starts (update() checks again).
    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    read_rows(batch, require=required_columns(config, batch), vocab_size=vocab_size)
    if config.pipeline_parallel_size > 1:
        from .pipeline import PipelinePolicyTrainer as trainer_class
    else:
        trainer_class = PolicyTrainer
    trainer = trainer_class(model_path, config)
    if args.resume:
        trainer.load(args.resume)
    metrics = trainer.update(batch)
    trainer.save_hf(join(args.out, "policy"))
    trainer.save(args.out)
    return metrics


def _quiet() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def _one_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    where = f"[rank {os.environ['RANK']}] " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    return f"gpu_jobs.train: {where}error: {type(exc).__name__}: {msg}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.print_config:
        import yaml

        from .config import ActorConfig

        print(yaml.safe_dump(ActorConfig().model_dump(mode="json"), sort_keys=False), end="")
        return 0
    missing = [f"--{k}" for k in ("batch", "checkpoint", "out") if getattr(args, k) is None]
    if missing:
        _parser().error(f"missing {', '.join(missing)}")
    _quiet()
    try:
        metrics = run(args)
    except Exception as exc:  # the job's contract: one clear line, non-zero exit
        if os.environ.get("RLMILL_DEBUG"):
            raise
        print(_one_line(exc), file=sys.stderr, flush=True)
        return 1
    finally:
        _shutdown()
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(metrics, sort_keys=True), flush=True)
    return 0


def _shutdown() -> None:
    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        td.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
