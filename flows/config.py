"""Loading a run config: a YAML file plus dotted overrides (rlmill's keys, or verl's, translated by
flows/verl_keys.py), validated into the typed RunConfig that lives with the stages
(gpu_jobs/stages/config.py).

    cfg = load_run_config("examples/grpo_arith.yaml", ["algorithm.adv_estimator=rloo", "rollout.n=8"])
    cfg = load_run_config(None, ["actor_rollout_ref.rollout.n=5", "trainer.total_training_steps=20"])
    cfg = load_run_config(None, ["+trainer.val_before_train=False", "~rollout.n"])   # hydra's forms

A YAML file may use verl's section names too (``actor_rollout_ref: {rollout: {n: 5}}``): its keys
mean what the same dotted keys mean on a command line. The overrides apply on top of the file.

A command validates its config once (load_run_config) and decides the run id once, on the
validated config (decide_run_id); what runs next receives both, typed.

    cfg, fresh = decide_run_id(load_run_config(path, overrides), path, overrides)
    check_startable(cfg)                               # the CLI (flows.user_errors), before Prefect starts
    with prepared_run(cfg, fresh, path, overrides):    # the CLI: the rl-training flow takes these
        rl_training(config=path, overrides=overrides)  # flows.training: flow_run_config() -> cfg, fresh, True
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flows.overrides import Delete, OverrideError, apply_items, config_names_run_id, unused_run_id
from flows.verl_keys import has_total_epochs, resolve_total_epochs, translate, translate_tree
from gpu_jobs.stages.config import (ARITH_PROBLEMS, ConfigError, RunConfig, build_run_config,  # noqa: F401
                                    config_from_run_json, config_keys, frozen_config, unknown_key_message)


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + overrides -> validated RunConfig. verl's keys in the file and among
    the overrides are translated first; an unsupported one raises ConfigError before any work."""
    data = _read_yaml(path) if path is not None else {}
    try:
        data = apply_items({}, translate_tree(data))
        items = translate(list(overrides))
        _deletes_known_keys(items)
        data = apply_items(data, items, default=_DefaultValues().at)
    except OverrideError as exc:
        raise ConfigError(str(exc)) from None
    if has_total_epochs(data):
        # verl's trainer.total_epochs: the step count needs the data, which the config names.
        placeholder = {**data, "trainer": {**data["trainer"], "total_iterations": 1}}
        data = resolve_total_epochs(data, build_run_config(placeholder))
    return build_run_config(data)


def decide_run_id(cfg: RunConfig, config: str | None, overrides: list[str], *, stem: str | None = None,
                  skip_taken: bool = True) -> tuple[RunConfig, str | None]:
    """The rule for run ids, applied to ``cfg`` (load_run_config(config, overrides)): a run that
    the config file and the overrides do not name (run_id, or verl's trainer.experiment_name) gets
    a fresh `<stem>-<YYYYmmdd-HHMMSS>` id (``stem``: the name of ``config``'s file unless given;
    "run" without either), skipping ids of runs that already exist under cfg.root unless
    ``skip_taken`` is off; naming an id resumes that run. Returns (cfg with its run id, the fresh
    id or None when the run was named). Reads no file but the config's and run.json files."""
    if config_names_run_id(config, overrides):
        return cfg, None
    from storage.layout import check_name

    fresh = check_name(unused_run_id(stem or config, (lambda c: run_exists(cfg, c)) if skip_taken else None),
                       "run_id")  # the field's own rule: model_copy does not run validators
    return cfg.model_copy(update={"run_id": fresh}), fresh


def run_exists(cfg: RunConfig, run_id: str) -> bool:
    """Whether run ``run_id`` has a run.json under cfg.root. Storage that does not answer counts
    as no: the run's own start reports it (flows.user_errors.check_startable)."""
    from storage import RunLayout

    try:
        return RunLayout(cfg.root, run_id, cfg.storage).read_run_json() is not None
    except Exception:  # noqa: BLE001 - reported by the storage check that comes next
        return False


@dataclass(frozen=True)
class PreparedRun:
    """A run config validated, a run id decided and the run checked startable
    (flows.user_errors.check_startable) by the caller of rl_training (the CLI), for the call with
    exactly these ``config``/``overrides`` parameters."""

    cfg: RunConfig
    fresh: str | None  # the id decided fresh (None: the config or overrides named the run)
    config: str | None
    overrides: list[str]


# Not a flow parameter: Prefect stores those in its API and shows them; a sync flow called
# in-process runs in the caller's thread and context, where this is visible.
_PREPARED: ContextVar[PreparedRun | None] = ContextVar("rlmill_prepared_run", default=None)


@contextmanager
def prepared_run(cfg: RunConfig, fresh: str | None, config: str | None, overrides: list[str]):
    """Within it, ``rl_training(config=config, overrides=overrides)`` trains ``cfg`` as given
    instead of validating the parameters, deciding the run id and checking that the run can start
    again: the caller has done all three (the CLI, before Prefect starts).

        with prepared_run(cfg, fresh, path, overrides):
            rl_training(config=path, overrides=overrides)
    """
    token = _PREPARED.set(PreparedRun(cfg, fresh, config, list(overrides)))
    try:
        yield
    finally:
        _PREPARED.reset(token)


def flow_run_config(config: str | None, overrides: list[str] | None, iterations: int | None,
                    run_id: str | None) -> tuple[RunConfig, str | None, bool]:
    """The rl-training flow's config, (fresh or None) run id, and whether its caller prepared it
    (and so checked it startable), from its parameters (``iterations`` and ``run_id``: shortcuts
    for trainer.total_iterations and run_id): the caller's prepared_run for this very call, else
    the parameters validated here, once, and the run id decided once (a deployment run, or a
    call from Python), unchecked."""
    extra = list(overrides or [])
    extra += [f"trainer.total_iterations={iterations}"] if iterations else []
    extra += [f"run_id={run_id}"] if run_id else []
    prepared = _PREPARED.get()
    if prepared is not None and (prepared.config, prepared.overrides) == (config, extra):
        return prepared.cfg, prepared.fresh, True
    return (*decide_run_id(load_run_config(config, extra), config, extra), False)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _deletes_known_keys(items: list[tuple[list[str], Any]]) -> None:
    """`~key` of a key the config does not have is refused as `key=value` would be (pydantic
    never sees a deleted key)."""
    keys = set(config_keys())
    unknown = [".".join(path) for path, value in items if isinstance(value, Delete) and ".".join(path) not in keys]
    if unknown:
        raise ConfigError("invalid run config:\n" + "\n".join(f"  {k}: {unknown_key_message(k)}" for k in unknown))


class _DefaultValues:
    """The value a key has when nothing sets it: what `~key=value` compares against when neither
    the file nor an earlier override set the key. Read from rlmill's default config (built on the
    first question only), so derived defaults (adv_estimator=grpo) are the ones a run would get."""

    def __init__(self) -> None:
        self._dump: dict[str, Any] | None = None

    def at(self, path: list[str]) -> Any:
        from flows.overrides import _MISSING

        if self._dump is None:
            self._dump = build_run_config({}, check_files=False).model_dump()
        node: Any = self._dump
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return _MISSING  # under a section that is off (critic: null), or no such key
            node = node[part]
        return node
