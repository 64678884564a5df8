"""rlmill's command line.

    rlmill run                                   # the main job: GRPO on the built-in task, before/after table
    rlmill train --config examples/grpo_arith.yaml algorithm.adv_estimator=rloo rollout.n=8
    rlmill train --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000   # resume that run
    rlmill data make arith --out s3://bucket/data/arith
    rlmill config show [--config FILE] [key=value ...]
    rlmill verify --config FILE run_id=... [--repair]
    rlmill models fetch smollm2                  # the real SmolLM2-135M-Instruct (what `make smollm2` runs)
    rlmill models list|promote|rollback NAME [VERSION] --root ROOT   # a registered model's versions, CURRENT moved
    rlmill --help, rlmill <command> --help       # what each needs, with examples (MAIN_HELP, TRAIN_HELP, ...)

Run ids: a run that the config and the overrides do not name gets a fresh id,
`<config file>-<YYYYmmdd-HHMMSS>`, printed first; `run_id=<id>` resumes that run.

A user's mistake (a bad key or value, a missing config, data or model file, a data file that is
not verl-format Parquet or has rows the data gate refuses, a storage root that does not answer or
cannot be written, a run id reused with another config, a run that does not exist, a dataset size
too large) ends in one `rlmill: ...` line naming the problem and the fix,
exit status 1, before any work; argparse's own usage errors
exit 2. Only those checked cases are turned into messages. Anything else is a bug: one
`rlmill: unexpected error` line, then its traceback, once (when the rl-training flow already
logged both, the console script only exits 1).

Here: run, train, verify and config show, the parser and main(); `rlmill data make` is
flows/cli_data.py, `rlmill models fetch` flows/cli_models.py, the help texts flows/cli_help.py,
and the ephemeral Prefect API server that dies with the CLI flows/cli_prefect.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from flows.cli_data import add_data_parser
from flows.cli_fork import add_fork_arguments, fork_plan, make_fork
from flows.cli_help import CONFIG_SHOW_HELP, MAIN_HELP, RUN_HELP, TRAIN_HELP, VERIFY_HELP
from flows.cli_models import add_models_parser
from flows.cli_prefect import _start_ephemeral_api
from flows.cli_serve import add_serve_parsers
from flows.cli_simulate import add_simulate_parser
from flows.user_errors import UserError, check_startable, user_error_line, user_error_types  # light: no heavy imports

# `rlmill run`'s config: examples/grpo_arith.yaml, embedded so that an installed wheel (which has
# no examples/ folder) runs the same job; tests/flows/test_cli.py checks that the two agree.
DEFAULT_CONFIG_NAME = "examples/grpo_arith.yaml"
DEFAULT_RUN_CONFIG: dict = {
    "root": ".rlmill",
    "model": {"path": "builtin"},
    "data": {"generate": "arith", "train_batch_size": 64, "val_size": 300},
    "rollout": {"engine": "hf", "n": 8, "temperature": 1.0, "max_response_length": 6},
    "algorithm": {"adv_estimator": "grpo"},
    "actor": {"lr": 1.0e-4, "ppo_mini_batch_size": 16, "ppo_epochs": 1, "use_dynamic_bsz": True,
              "ppo_max_token_len_per_gpu": 16384, "log_prob_micro_batch_size_per_gpu": 256,
              "recompute_old_logprobs": False, "grad_clip": 1.0, "zero_stage": "auto"},
    "trainer": {"total_iterations": 20, "val_every": 5, "checkpoint_every": 5},
}


def as_overrides(config: dict, prefix: str = "") -> list[str]:
    """A nested config as dotted `key=value` overrides (values as JSON, which YAML reads back)."""
    import json

    out = []
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out += as_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


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


# What `train` would otherwise find out only inside the flow, minutes in (flows.user_errors).
_check_startable = check_startable


# Prefect stores a flow run's parameters in its API (and shows them in the UI), so credentials
# given on the command line travel to the flow as the environment botocore reads instead.
SECRET_OVERRIDES = {"storage.key": "AWS_ACCESS_KEY_ID", "storage.secret": "AWS_SECRET_ACCESS_KEY",
                    "storage.token": "AWS_SESSION_TOKEN"}


def _key_of(text: str) -> tuple[str, str, str | None]:
    """(hydra prefix "", "+", "++" or "~"; dotted key; value or None) of one override as typed."""
    prefix = next((p for p in ("++", "+", "~") if text.startswith(p)), "")
    key, sep, value = text[len(prefix):].partition("=")
    return prefix, key.strip(), value if sep else None


def _secrets_to_env(overrides: list[str]) -> list[str]:
    """Move `storage.key/secret/token=...` overrides (hydra's `+`/`++` forms too) into AWS_*
    variables; return the others."""
    kept = []
    for text in overrides:
        prefix, key, value = _key_of(text)
        if prefix != "~" and value is not None and key in SECRET_OVERRIDES:
            os.environ[SECRET_OVERRIDES[key]] = value
        else:
            kept.append(text)
    return kept


def _decide_run_id(cfg, config: str | None, overrides: list[str], **how):
    """flows.config.decide_run_id: this command's one decision of the run id, on its validated config."""
    from flows.config import decide_run_id

    return decide_run_id(cfg, config, overrides, **how)


def _announce(cfg, fresh: str | None, fork: str | None = None) -> None:
    """The run id, first thing, how to resume the run, and the run it was forked from."""
    forked = f", forked from {fork}" if fork else ""
    if fresh:
        print(f"rlmill: new run {cfg.run_id}{forked}; to resume it, run the same command with run_id={cfg.run_id}",
              flush=True)
        return
    from flows.user_errors import run_start_words

    print(f"rlmill: run {cfg.run_id} ({run_start_words(cfg)}{forked})", flush=True)


def _check_storage(cfg, write: bool = True) -> None:
    """The run's storage root answers and takes writes (seconds; storage.probe), before anything
    else reads it: a wrong endpoint, a missing bucket, refused credentials or a read-only folder
    is one `rlmill:` line here instead of an error from inside the flow."""
    from storage.probe import check_root

    check_root(cfg.root, cfg.storage, write=write)


def cmd_train(args) -> None:
    """Validate once, check storage, decide the run id once, check the run can start, then hand
    the typed config and the id to the rl-training flow (flows.config.prepared_run): nothing
    is parsed, validated or decided twice."""
    overrides = _secrets_to_env(args.overrides)  # credentials never reach a flow's parameters or run.json
    cfg = _check_config(args.config, overrides)
    _check_storage(cfg)  # before Prefect, a model or any write; deciding the id reads run.json files
    cfg, fresh = _decide_run_id(cfg, args.config, overrides)
    fork = fork_plan(cfg, args)  # --from RUN@K: every check of the fork before any write (flows/cli_fork.py)
    _check_startable(cfg)
    _announce(cfg, fresh, fork and fork.summary())
    make_fork(fork)  # the child's copy of the checkpoint, then its run.json: the run then resumes from it
    resume = ["rlmill", "train", *(["--config", args.config] if args.config else []),
              *_plain_overrides(args.overrides), f"run_id={cfg.run_id}"]
    # The flow run's parameters name the run as the CLI decided it (the UI shows them).
    flow_overrides = [*overrides, f"run_id={fresh}"] if fresh else overrides
    summary = _run_flow(cfg, fresh, resume, args.config, flow_overrides)
    _print_summary(summary, PREFERENCE_LABEL if cfg.preference is not None else SFT_LABEL if cfg.sft is not None
                   else SUMMARY_LABEL)


def _run_flow(cfg, fresh: str | None, resume: list[str], config: str | None, overrides: list[str],
              threads: int | None = None) -> dict:
    """The rl-training flow on this command's validated ``cfg`` (and ``fresh`` id), stoppable by
    SIGINT/SIGTERM with ``resume`` named; ``config``/``overrides`` are its Prefect parameters;
    ``threads``: torch's intra-op threads for the run (None: torch's default)."""
    with _stoppable(cfg, resume):
        _start_ephemeral_api()
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from flows import training
        from flows.config import prepared_run

        with prepared_run(cfg, fresh, config, overrides):
            return training.rl_training(config=config, overrides=overrides)


def _plain_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides but run_id= and the storage credentials (never printed)."""
    keys = {*SECRET_OVERRIDES, "run_id"}
    return [o for o in overrides if _key_of(o)[1] not in keys]


def _stoppable(cfg, resume: list[str]):
    """SIGINT and SIGTERM stop the run (flows/stopping.py); the line printed then names the
    committed iterations and `resume`, the command that goes on from them."""
    import shlex

    from flows import stopping

    def line(signum: int) -> str:
        from flows.training import committed_iterations

        return stopping.stop_line(cfg.run_id, signum, committed_iterations(cfg), shlex.join(resume))

    stopping.set_line(line, cfg.tasks.stop_grace_seconds)
    return stopping.stop_signals(cfg.tasks.stop_grace_seconds)


def cmd_run(args) -> None:
    """The main job: a fresh run id each time (unless --run-id or run_id= names one to resume),
    so `make run` always trains and shows the gain. The config is examples/grpo_arith.yaml,
    embedded. Validated once and its run id decided once, as `rlmill train` does."""
    named = [f"run_id={args.run_id}"] if args.run_id else []
    overrides = _secrets_to_env([*as_overrides(DEFAULT_RUN_CONFIG), *args.overrides, *named])
    cfg = _check_config(None, overrides)
    _check_storage(cfg)
    cfg, _ = _decide_run_id(cfg, None, overrides, stem=DEFAULT_CONFIG_NAME)
    _check_startable(cfg)
    run_id = cfg.run_id
    print(f"rlmill: GRPO on the built-in arithmetic task ({DEFAULT_CONFIG_NAME}), run {run_id}; "
          f"to resume it: rlmill run --run-id {run_id}", flush=True)
    resume = ["rlmill", "run", "--run-id", run_id, *_plain_overrides(args.overrides)]
    summary = _run_flow(cfg, None, resume, None, [*overrides, f"run_id={run_id}"],
                        threads=max(1, min(2, os.cpu_count() or 1)))
    _print_summary(summary)


# val/acc is the mean reward score of greedy answers on the held-out set (for the built-in
# arithmetic task, whose reward is 1 for the right sum and 0 otherwise, that is exact match).
SUMMARY_LABEL = "held-out mean score (val/acc)"
# A DPO/KTO run (a `preference:` section) validates on held-out pairs: the share its implicit reward orders right.
PREFERENCE_LABEL = "held-out preference accuracy (val/acc)"
SFT_LABEL = "held-out exact match (val/acc)"  # an `sft:` run: the held-out rows greedy decoding reproduces


def _print_summary(summary: dict, label: str = SUMMARY_LABEL) -> None:
    before, after = summary["val/acc before"], summary["val/acc after"]
    what = "training" if label in (PREFERENCE_LABEL, SFT_LABEL) else "RL"
    width = max(41, len(f"{label}, before {what}") + 1)
    print()
    print(f"{'run':<{width}} {summary['run_id']}")
    if before is None:
        print(f"{label + f', before {what}':<{width}} not measured (trainer.val_before_train=false)")
    else:
        print(f"{label + f', before {what}':<{width}} {100 * before:6.1f} %")
    print(f"{label + f', after {what}':<{width}} {100 * after:6.1f} %")
    if before is not None:
        print(f"{'change':<{width}} {100 * (after - before):+6.1f} points")
    print(f"{'iterations':<{width}} {summary['iterations']}")
    curve = summary.get("val_curve", [])
    for k, elapsed, acc in curve[1:] if before is not None else curve:  # its first point is "before" (a fork's: K)
        label = f"  after iteration {k} ({elapsed:.0f} s training)"
        change = "" if before is None else f"  ({100 * (acc - before):+.1f})"
        print(f"{label:<{width}} {100 * acc:6.1f} %{change}")
    print(f"{'training wall time (s)':<{width}} {summary['train seconds (this process)']}")
    print(f"{'curves':<{width}} {summary['curves'] or '(none: matplotlib is not installed)'}")


def cmd_verify(args) -> None:
    """Read back every committed table and checkpoint of the run; --repair sets aside what can be
    recomputed. Exits 1 while damage that needs the user remains."""
    from gpu_jobs.stages.verify import set_aside, verify_run
    from storage import RunLayout, exists

    from flows.overrides import config_names_run_id

    cfg = _check_config(args.config, args.overrides)
    _check_storage(cfg, write=args.repair)  # reading needs an answering root; --repair writes too
    if not config_names_run_id(args.config, args.overrides):
        raise UserError(f"name the run to check: add run_id=<id> (under {cfg.root}; runs there: {_runs_under(cfg)})")
    layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
    if layout.read_run_json() is None and not exists(layout.root, cfg.storage):
        raise UserError(f"no run {cfg.run_id!r} under {cfg.root}; runs there: {_runs_under(cfg)}. "
                        "Check run_id= and root= (and --config)")
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


def _runs_under(cfg, most: int = 20) -> str:
    from storage import join, url_to_fs

    fs, path = url_to_fs(join(cfg.root, "runs"), cfg.storage)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.exists(path) else []
    if not names:
        return "none"
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def cmd_config_show(args) -> None:
    """The validated config `rlmill train` would run with these arguments, every default filled
    in. The run id is the one train would use: a config and overrides that name no run get a
    fresh `<config file>-<date>-<time>` at each train, shown as it would be now."""
    import yaml

    cfg = _check_config(args.config, args.overrides)
    cfg, fresh = _decide_run_id(cfg, args.config, args.overrides, skip_taken=False)  # no storage read
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if fresh:
        text = text.replace(f"run_id: {fresh}\n", f"run_id: {fresh}  # new at each `rlmill train`: <config file>-"
                            "<date>-<time> when it starts; run_id=<id> resumes that run\n", 1)
    print(text)


RAW = argparse.RawDescriptionHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlmill", formatter_class=RAW, epilog=MAIN_HELP,
                                description="RL post-training of language models (GRPO, PPO, DAPO, RLOO, ...) as "
                                            "Prefect flows,\nwith verl's names for keys and metrics.")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    _add_run_parser(sub)
    _add_train_parser(sub)
    _add_verify_parser(sub)
    add_data_parser(sub, RAW)
    add_models_parser(sub)
    add_serve_parsers(sub)
    add_simulate_parser(sub)
    _add_config_parser(sub)
    return p


def _add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="the main job: GRPO on the built-in task, accuracy before and after",
                         description="The main job: GRPO on the built-in task, accuracy before and after.",
                         formatter_class=RAW, epilog=RUN_HELP)
    run.add_argument("--run-id", default=None, metavar="ID", help="resume run ID (default: a new timestamped run)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. trainer.total_iterations=10")
    run.set_defaults(fn=cmd_run)


def _add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="train a run a config describes, or resume it (run_id=ID)",
                           description="Train the run a config describes, or resume it.", formatter_class=RAW,
                           epilog=TRAIN_HELP)
    train.add_argument("--config", default=None, metavar="FILE",
                       help="YAML run config, e.g. examples/grpo_arith.yaml (default: rlmill's defaults)")
    add_fork_arguments(train)
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted overrides, e.g. rollout.n=8, run_id=ID (resume), root=/tmp/rl")
    train.set_defaults(fn=cmd_train)


def _add_verify_parser(sub) -> None:
    verify = sub.add_parser("verify", help="check every committed table and checkpoint of a run (--repair)",
                            description="Check every committed table and checkpoint of a run.", formatter_class=RAW,
                            epilog=VERIFY_HELP)
    verify.add_argument("--config", default=None, metavar="FILE", help="the YAML config the run was started with")
    verify.add_argument("--repair", action="store_true",
                        help="set aside damaged stages of the iteration in flight so `train` recomputes them")
    verify.add_argument("overrides", nargs="*", metavar="key=value",
                        help="run_id=ID (required: the id `rlmill train` printed), and root= or other overrides "
                             "the run was started with")
    verify.set_defaults(fn=cmd_verify)


def _add_config_parser(sub) -> None:
    # fn is looked up when the parser is built, so a test may stand in for cmd_config_show.
    cfg = sub.add_parser("config", help="configs: rlmill config show lists every key").add_subparsers(
        dest="config_command", required=True, metavar="command")
    show = cfg.add_parser("show", help="print the full validated config with every default",
                          description="Print the full validated config with every default.", formatter_class=RAW,
                          epilog=CONFIG_SHOW_HELP)
    show.add_argument("--config", default=None, metavar="FILE", help="YAML run config (default: rlmill's defaults)")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as `rlmill train` takes")
    show.set_defaults(fn=cmd_config_show)


def main(argv: list[str] | None = None) -> None:
    _quiet_env()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse takes a command's key=value overrides in one run: `verify run_id=r --repair
        # root=x` leaves root=x over. Such leftovers are overrides too, in their order.
        if isinstance(getattr(args, "overrides", None), list) and \
                all(("=" in e or e.startswith("~")) and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.fn(args)
    except KeyboardInterrupt as stop:  # RunStopped: SIGINT/SIGTERM during a run (flows/stopping.py)
        _stopped(stop)
    except BrokenPipeError:  # `rlmill config show | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        sys.exit(1)
    except Exception as exc:
        line = _user_line(exc)
        if line is not None:  # checked user input only: any other exception keeps its traceback
            sys.exit(f"rlmill: {line}")
        if not getattr(exc, "rlmill_reported", False):  # the flow logged its summary and traceback
            what = " ".join(f"{type(exc).__name__}: {exc}".split())
            print(f"rlmill: unexpected error: {what} (not a mistake rlmill recognises in the input; "
                  "the traceback follows)", file=sys.stderr, flush=True)
        raise


def _stopped(stop: KeyboardInterrupt) -> None:
    """The end of a run SIGINT or SIGTERM stopped: its one line, its ephemeral Prefect server
    stopped (past the grace it dies with us instead), exit status 130 or 143."""
    from flows import stopping

    if not isinstance(stop, stopping.RunStopped):  # Ctrl-C outside a run (a command without a run)
        raise stop
    stopping.say_once(stop.signum)
    from flows.cli_prefect import _stop_ephemeral_api

    _stop_ephemeral_api()
    stopping.hard_exit(stop.signum)  # Prefect's own exit hooks are done above; others may wait on threads


def _user_line(exc: BaseException) -> str | None:
    """The `rlmill:` line for a user's mistake: the CLI's checks, or what the rl-training flow
    ended with (its Failed state carries the exception, see flows.training.rl_training)."""
    from storage.probe import StorageCheckError

    if isinstance(exc, StorageCheckError):
        return str(exc)
    if isinstance(exc, user_error_types()):
        return user_error_line(exc, one_line=False)
    return getattr(exc, "rlmill_line", None)


def entry() -> None:
    """The console script (`rlmill`, `python -m flows.cli`): main(), except that an error the
    rl-training flow already reported -- its summary line and its traceback are in the flow's
    log above -- ends with exit status 1 instead of a second copy of the traceback."""
    try:
        main()
    except Exception as exc:
        if getattr(exc, "rlmill_reported", False):
            sys.exit(1)
        raise


if __name__ == "__main__":
    entry()
