"""rlmill's command line.

    rlmill run                                   # the main job: GRPO on the built-in task, before/after table
    rlmill train --config examples/grpo_arith.yaml algorithm.adv_estimator=rloo rollout.n=8
    rlmill data make arith --out s3://bucket/data/arith
    rlmill config show [--config FILE] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEFAULT_CONFIG = EXAMPLES / "grpo_arith.yaml"


def _quiet_env() -> None:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The ephemeral API server needs >20 s to start when the two cores are busy.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def _check_config(path: str | None, overrides: list[str]):
    from flows.config import ConfigError, load_run_config

    try:
        return load_run_config(path, overrides)
    except (ConfigError, ValueError) as exc:
        sys.exit(f"rlmill: {exc}")


# Prefect stores a flow run's parameters in its API (and shows them in the UI), so credentials
# given on the command line travel to the flow as the environment botocore reads instead.
SECRET_OVERRIDES = {"storage.key": "AWS_ACCESS_KEY_ID", "storage.secret": "AWS_SECRET_ACCESS_KEY",
                    "storage.token": "AWS_SESSION_TOKEN"}


def _secrets_to_env(overrides: list[str]) -> list[str]:
    """Move `storage.key/secret/token=...` overrides into AWS_* variables; return the others."""
    kept = []
    for text in overrides:
        key, sep, value = text.partition("=")
        if sep and key.strip() in SECRET_OVERRIDES:
            os.environ[SECRET_OVERRIDES[key.strip()]] = value
        else:
            kept.append(text)
    return kept


def cmd_train(args) -> None:
    _check_config(args.config, args.overrides)  # fail before Prefect or any model starts
    from flows.training import rl_training

    summary = rl_training(config=args.config, overrides=_secrets_to_env(args.overrides))
    _print_summary(summary)


def cmd_run(args) -> None:
    """The main job: a fresh run id each time, so `make run` always trains and shows the gain."""
    run_id = args.run_id or time.strftime("grpo-arith-%Y%m%d-%H%M%S")
    overrides = [f"run_id={run_id}", *args.overrides]
    _check_config(str(DEFAULT_CONFIG), overrides)
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from flows.training import rl_training

    print(f"rlmill: GRPO on the built-in arithmetic task, config {DEFAULT_CONFIG.name}, run {run_id}")
    summary = rl_training(config=str(DEFAULT_CONFIG), overrides=_secrets_to_env(overrides))
    _print_summary(summary)


def _print_summary(summary: dict) -> None:
    before, after = summary["val/acc before"], summary["val/acc after"]
    width = 37
    print()
    print(f"{'run':<{width}} {summary['run_id']}")
    print(f"{'held-out exact match, before RL':<{width}} {100 * before:6.1f} %")
    print(f"{'held-out exact match, after RL':<{width}} {100 * after:6.1f} %")
    print(f"{'change':<{width}} {100 * (after - before):+6.1f} points")
    print(f"{'iterations':<{width}} {summary['iterations']}")
    for k, elapsed, acc in summary.get("val_curve", [])[1:]:
        label = f"  after iteration {k} ({elapsed:.0f} s training)"
        print(f"{label:<{width}} {100 * acc:6.1f} %  ({100 * (acc - before):+.1f})")
    print(f"{'training wall time (s)':<{width}} {summary['train seconds (this process)']}")
    print(f"{'curves':<{width}} {summary['curves']}")


def cmd_verify(args) -> None:
    """Read back every committed table and checkpoint of the run; --repair sets aside what can be
    recomputed. Exits 1 while damage that needs the user remains."""
    from gpu_jobs.stages.verify import set_aside, verify_run
    from storage import RunLayout

    cfg = _check_config(args.config, args.overrides)
    layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
    found = verify_run(layout)
    if not found:
        print(f"run {cfg.run_id}: every committed table and checkpoint is intact")
        return
    for d in found:
        print(f"DAMAGED {d.what}: {d.error}\n  -> {d.action}")
        if args.repair and d.repairable:
            print(f"  set aside as {set_aside(layout, d)}; `rlmill train` recomputes it")
    if any(not d.repairable and not d.what.startswith("checkpoint") for d in found):
        sys.exit(1)
    if not args.repair and any(d.repairable for d in found):
        sys.exit("rlmill: run `rlmill verify --repair` with the same config to set the damaged stages aside")


def cmd_data_make(args) -> None:
    from storage.datasets import make_dataset

    train, test = make_dataset(args.name, args.out, train_size=args.train_size, test_size=args.test_size,
                               seed=args.seed)
    print(f"wrote {train}\nwrote {test}")


def cmd_config_show(args) -> None:
    import yaml

    cfg = _check_config(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmill", description="RL post-training as Prefect flows")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="the main job: GRPO on the built-in task with embedded defaults")
    run.add_argument("--run-id", default=None, help="run id (default: a new timestamped one)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_iterations=10")
    run.set_defaults(fn=cmd_run)

    train = sub.add_parser("train", help="train (or resume) the run a config describes")
    train.add_argument("--config", default=None, help="YAML run config (see examples/)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8")
    train.set_defaults(fn=cmd_train)

    verify = sub.add_parser("verify", help="check every committed table and checkpoint of a run (--repair)")
    verify.add_argument("--config", default=None, help="the run's YAML config")
    verify.add_argument("--repair", action="store_true",
                        help="set aside damaged stages of the iteration in flight so `train` recomputes them")
    verify.add_argument("overrides", nargs="*")
    verify.set_defaults(fn=cmd_verify)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    make = data.add_parser("make", help="write a built-in dataset as verl-format train/test Parquet")
    make.add_argument("name", help="arith | gsm_symbolic | rg:<reasoning-gym task>")
    make.add_argument("--out", required=True, help="folder URL (local, s3://...)")
    make.add_argument("--train-size", type=int, default=20000)
    make.add_argument("--test-size", type=int, default=1000)
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(fn=cmd_data_make)

    cfg = sub.add_parser("config", help="configs").add_subparsers(dest="config_command", required=True)
    show = cfg.add_parser("show", help="print the full validated config with every default")
    show.add_argument("--config", default=None)
    show.add_argument("overrides", nargs="*")
    show.set_defaults(fn=cmd_config_show)
    return p


def main(argv: list[str] | None = None) -> None:
    _quiet_env()
    args = build_parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
