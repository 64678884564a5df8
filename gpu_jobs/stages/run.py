"""The frozen run: its config, storage layout, model folder, tokenizer and prompts. No weights.

    run = Run.open(cfg)                          # writes run.json once; datasets built and gated
    run = Run.from_storage(".rlmill", "my-run")  # the same run in another process, from run.json

Opening a run is cheap and does every check of the user's input before anything of the run is
written except the data gate's report: missing files, overlong prompts, a reused run id whose
config differs. The warm roles that compute on it live in `roles.py`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from typing import Any

from gpu_jobs.stages.config import RunConfig, config_from_run_json, frozen_config
from storage import ObjectExistsError, RunLayout, exists, join
from storage.datasets import read_prompts
from gpu_jobs.data import PromptSampler, make_dataset
from gpu_jobs.data.generators import held_out_size

log = logging.getLogger("rlmill")

# Keys that may differ between the frozen run.json and a resuming invocation: extending a run,
# or changing how often it reports, does not change what any committed stage computed.
RESUMABLE_KEYS = {("trainer", "total_iterations"), ("trainer", "val_every"), ("trainer", "samples_in_artifact"),
                  ("trainer", "loggers"), ("trainer", "tensorboard"), ("tasks", "retries"),
                  ("tasks", "retry_delay_seconds"), ("tasks", "timeout_seconds"),
                  # how long storage waits out an outage, and how many ranks train: neither changes
                  # what a committed stage means (a run.json from before these keys resumes too)
                  ("storage", "retry_budget_seconds"), ("storage", "retry_max_delay_seconds"),
                  ("trainer", "n_gpus_per_node"), ("trainer", "nnodes"), ("trainer", "master_addr"),
                  ("trainer", "master_port"),
                  # where a remote stage runs changes nothing it computes (bitwise, tests/flows/test_remote.py)
                  ("trainer", "stage_deployment"), ("trainer", "rollout_deployment")}


class RunConfigMismatchError(ValueError):
    """A run id was reused with a config that would change what its committed stages mean."""


class Run:
    """A run's frozen parts. A plain class, not a dataclass: Prefect walks dataclass task
    arguments field by field, and this one holds whole datasets."""

    def __init__(self, cfg: RunConfig, layout: RunLayout, run_uid: str, model_path: str, tokenizer: Any,
                 train: Any, val: Any, sampler: PromptSampler):
        self.cfg, self.layout, self.run_uid = cfg, layout, run_uid
        self.model_path, self.tokenizer = model_path, tokenizer
        self.train, self.val, self.sampler = train, val, sampler  # pandas frames of verl rows

    @property
    def storage(self):
        return self.cfg.storage

    def __repr__(self) -> str:  # what Prefect and logs show: never the datasets
        return f"Run({self.cfg.run_id!r} under {self.layout.root_url})"

    def prompts(self, df: Any, rows: list[int], max_len: int | None) -> tuple[list[dict], list[list[int]]]:
        """Rows of a prompt dataset (verl fields plus `row`, their index) and their token ids:
        a served agent's row (tool calls, tool results, a `tools` column) as `rlmill serve`
        rendered it (see _row_tools)."""
        from gpu_jobs.data import render_prompt
        from gpu_jobs.data.rendering import TOOLS_KEY
        from gpu_jobs.chat.hermes import render_chat

        prompts = [dict(df.iloc[i].to_dict(), row=int(i)) for i in rows]
        key, tok = self.cfg.data.prompt_key, self.tokenizer
        if not _row_tools(self.cfg):
            return prompts, [render_prompt(p[key], tok, max_len) for p in prompts]
        return prompts, [render_chat(p[key], tok, p.get(TOOLS_KEY), max_len) for p in prompts]

    def batch_prompts(self, k: int) -> tuple[list[dict], list[list[int]]]:
        """Iteration k's training prompts: a pure function of (seed, epoch, k)."""
        rows = self.sampler.indices(k - 1)  # iterations are 1-based, the sampler's steps 0-based
        return self.prompts(self.train, rows, self.cfg.data.max_prompt_length)

    @classmethod
    def open(cls, cfg: RunConfig) -> "Run":
        from gpu_jobs.data.rendering import with_prompt_template
        from gpu_jobs.models import load_tokenizer, resolve_model_path

        layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
        if cfg.preference is not None:
            return cls._open_preference(cfg, layout)
        if cfg.sft is not None:
            return cls._open_sft(cfg, layout)
        train_urls, val_urls = _datasets(cfg)
        train = read_prompts(train_urls, storage=cfg.storage)
        val = read_prompts(val_urls, storage=cfg.storage).iloc[: cfg.data.val_size].reset_index(drop=True)
        model_path = resolve_model_path(cfg.model.path, cfg.storage, seed=cfg.model.seed)
        tokenizer = with_prompt_template(load_tokenizer(model_path), cfg.data.completion_template)
        train = _prompts_within_length(cfg, "train", train, tokenizer)
        val = _prompts_within_length(cfg, "val", val, tokenizer)
        # Gate the prompts before the run exists: bad data fails here, naming rows, with nothing
        # of the run written but the gate's own report.
        train = _gate_prompts(cfg, layout, "train", train, tokenizer)
        val = _gate_prompts(cfg, layout, "val", val, tokenizer)
        run_uid = _freeze(layout, frozen_config(cfg))
        sampler = PromptSampler(seed=cfg.data.seed, batch_size=cfg.data.train_batch_size, n_rows=len(train))
        return cls(cfg, layout, run_uid, model_path, tokenizer, train, val, sampler)

    @classmethod
    def _open_preference(cls, cfg: RunConfig, layout: RunLayout) -> "Run":
        """A preference run: train/val are frames of TRL rows (preference_data.py), read and
        checked before the model is resolved; the sampler draws pairs/examples, not prompts."""
        from gpu_jobs.models import load_tokenizer, resolve_model_path
        from gpu_jobs.stages.preference_data import check_prompt_lengths, preference_frames

        train, val = preference_frames(cfg)
        model_path = resolve_model_path(cfg.model.path, cfg.storage, seed=cfg.model.seed)
        tokenizer = load_tokenizer(model_path)
        for where, df in (("preference training data", train), ("held-out preference data", val)):
            check_prompt_lengths(df, tokenizer, cfg.data.max_prompt_length, where)
        run_uid = _freeze(layout, frozen_config(cfg))
        sampler = PromptSampler(seed=cfg.data.seed, batch_size=cfg.data.train_batch_size, n_rows=len(train))
        return cls(cfg, layout, run_uid, model_path, tokenizer, train, val, sampler)

    @classmethod
    def _open_sft(cls, cfg: RunConfig, layout: RunLayout) -> "Run":
        """An SFT run: train/val are frames of demonstrations (sft_data.py), read and checked
        before the model is resolved, every row's length checked before the run exists."""
        from gpu_jobs.models import load_tokenizer, resolve_model_path
        from gpu_jobs.stages.sft_data import check_lengths, sft_frames

        train, val = sft_frames(cfg)
        model_path = resolve_model_path(cfg.model.path, cfg.storage, seed=cfg.model.seed)
        tokenizer = load_tokenizer(model_path)
        check_lengths(cfg, tokenizer, {"sft training data": train, "held-out sft data": val})
        run_uid = _freeze(layout, frozen_config(cfg))
        sampler = PromptSampler(seed=cfg.data.seed, batch_size=cfg.data.train_batch_size, n_rows=len(train))
        return cls(cfg, layout, run_uid, model_path, tokenizer, train, val, sampler)

    @classmethod
    def from_storage(cls, root: str, run_id: str) -> "Run":
        """An existing run from its run.json alone (a process that did not start it: a remote
        stage, a fresh worker). Storage credentials come from this process's AWS_* environment;
        run.json never holds them."""
        frozen = RunLayout(root, run_id).read_run_json()
        if frozen is None:
            raise RuntimeError(f"no run {run_id!r} under {root}: start it with `rlmill train` first")
        return cls.open(config_from_run_json(frozen))


def sampling_seed(seed: int, k: int) -> int:
    """Per-iteration sampling seed: a retried rollout draws exactly the same responses."""
    return (seed * 1_000_003 + k * 7919) % (2**31 - 1)


def last_committed(layout: RunLayout, stage: str, limit: int = 1_000_000) -> int:
    """Highest k whose `stage` committed, scanning up from the run's first iteration: 1, or for a
    forked run the one after its fork point (layout.fork_base(), gpu_jobs/stages/fork.py), which
    is returned when none has (0 for a run not forked)."""
    from storage import committed

    k = layout.fork_base()
    while k < limit and committed(layout.stage(k + 1, stage), layout.storage):
        k += 1
    return k


_ABSENT = object()


def _diff(a: Any, b: Any, defaults: Any = None, prefix: tuple = ()) -> list[tuple]:
    """Keys whose values differ between frozen `a` and current `b`. A key `a` lacks (the run was
    frozen by an older rlmill, before the key existed) counts as holding its default, so a run
    made before a new feature resumes as long as the feature stays off."""
    if a is _ABSENT:
        a = defaults
    if isinstance(a, dict) and isinstance(b, dict):
        d = defaults if isinstance(defaults, dict) else {}
        out = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key, _ABSENT), b.get(key), d.get(key), prefix + (key,))
        return out
    return [] if a == b else [prefix]


@functools.cache
def _default_config() -> dict:
    return json.loads(json.dumps(frozen_config(RunConfig()), default=str))


def check_config_matches(layout: RunLayout, frozen: dict, config: dict) -> None:
    """Raise RunConfigMismatchError when `config` (a frozen_config dump) would change what the
    committed stages of the run whose run.json is `frozen` mean. Extending a run is allowed."""
    changed = [d for d in _diff(frozen.get("config", {}), json.loads(json.dumps(config, default=str)),
                                _default_config())
               if d[:2] not in RESUMABLE_KEYS]
    if changed:
        keys = ", ".join(".".join(map(str, d)) for d in changed[:8])
        raise RunConfigMismatchError(
            f"run {layout.run_id!r} already exists under {layout.root_url} with a different config "
            f"({keys}); resume it with the same config, or start a new run with another run_id")


def _freeze(layout: RunLayout, config: dict) -> str:
    """Write run.json once; on a resume, check the config still matches. Returns the run's uid.

    The uid is minted when the run is first created: a run deleted and started again under the
    same id is a different run, and Prefect cache keys include the uid so they never cross.
    """
    from gpu_jobs.stages.lineage import model_source

    try:
        uid = uuid.uuid4().hex
        source = model_source(config["model"]["path"], layout.storage)  # a chain: SFT then RL (lineage.py)
        layout.write_run_json({"run_uid": uid, "created_at": time.time(), "config": config,
                               **({"model_source": source} if source else {})})
        return uid
    except ObjectExistsError:
        pass
    frozen = layout.read_run_json() or {}
    check_config_matches(layout, frozen, config)
    return frozen["run_uid"]


def _datasets(cfg: RunConfig) -> tuple[list[str], list[str]]:
    data = cfg.data
    if data.train_files:
        return list(data.train_files), list(data.val_files or data.train_files)
    if data.generate is None:
        raise ValueError("data.train_files is empty and data.generate is null: name a dataset or files")
    test_size = held_out_size(data.generate, data.val_size)
    name = f"{data.generate.replace(':', '-')}-seed{data.seed}-n{data.train_size}"
    out = join(cfg.root, "datasets", name if test_size == max(data.val_size, 300) else f"{name}-t{test_size}")
    train_url, test_url = join(out, "train.parquet"), join(out, "test.parquet")
    if not (exists(train_url, cfg.storage) and exists(test_url, cfg.storage)):
        make_dataset(data.generate, out, train_size=data.train_size, test_size=test_size,
                     seed=data.seed, storage=cfg.storage)
    return [train_url], list(data.val_files or [test_url])


def _prompts_within_length(cfg: RunConfig, split: str, df: Any, tokenizer: Any) -> Any:
    """data.overlong_prompts: 'error' refuses a prompt longer than data.max_prompt_length (naming
    its row) before anything of the run is written; 'filter' drops such rows and says how many
    (verl's filter_overlong_prompts). Malformed prompts are left for the data gate to name."""
    from gpu_jobs.data import OverlongPromptError, render_prompts
    from gpu_jobs.data.rendering import TOOLS_KEY, normalize_messages
    from gpu_jobs.chat.hermes import render_chats

    prompts = df[cfg.data.prompt_key].tolist()
    well_formed = [i for i, p in enumerate(prompts) if _normalizes(normalize_messages, p)]
    as_filter = cfg.data.model_copy(update={"overlong_prompts": "filter"})
    render = None  # measured as Run.prompts renders them
    if _row_tools(cfg):
        tools = df[TOOLS_KEY].tolist() if TOOLS_KEY in df.columns else [None] * len(prompts)
        render = functools.partial(render_chats, tokenizer=tokenizer, tools=[tools[i] for i in well_formed])
    _, kept, n_filtered = render_prompts([prompts[i] for i in well_formed], tokenizer, as_filter, render)
    if not n_filtered:
        return df
    dropped = sorted(set(well_formed) - {well_formed[i] for i in kept})
    if cfg.data.overlong_prompts == "error":
        raise OverlongPromptError(
            f"{split} prompts: {len(dropped)} longer than data.max_prompt_length={cfg.data.max_prompt_length} "
            f"tokens, first at row {dropped[0]}; raise data.max_prompt_length or set data.overlong_prompts=filter")
    log.warning("%s prompts: dropped %d of %d longer than data.max_prompt_length=%d (data.overlong_prompts=filter)",
                split, n_filtered, len(df), cfg.data.max_prompt_length)
    if len(dropped) == len(df):
        raise OverlongPromptError(f"every {split} prompt is longer than data.max_prompt_length="
                                  f"{cfg.data.max_prompt_length}: raise it")
    return df.drop(index=df.index[dropped]).reset_index(drop=True)


def _row_tools(cfg: RunConfig) -> bool:
    """Whether prompts are rendered with their rows' tools (verl's `tools` column), tool calls
    and results (hermes.render_chat, as `rlmill serve` rendered them). Not in a multi-turn run:
    its rollout shows its own rollout.multi_turn tools and takes each prompt as render_prompt
    renders the row's messages (turn_formats.HermesTurns.prompt checks it)."""
    return not cfg.rollout.multi_turn.enable


def _normalizes(normalize: Any, prompt: Any) -> bool:
    try:
        msgs = normalize(prompt)
    except (KeyError, TypeError, IndexError, AttributeError):
        return False
    return bool(msgs) and all(isinstance(m["content"], str) and isinstance(m["role"], str) for m in msgs)


def _gate_prompts(cfg: RunConfig, layout: RunLayout, split: str, df: Any, tokenizer: Any) -> Any:
    """great-expectations suite over a prompt dataset; quarantined rows are counted and written."""
    from gpu_jobs.data import render_many
    from gpu_jobs.data.gates import validate_prompts

    gate = cfg.gate.model_copy(update={"max_prompt_length": cfg.data.max_prompt_length})
    where = join(layout.root, "data_gate")
    result = validate_prompts(df, gate, join(where, f"{split}_report.json"),
                              render=functools.partial(render_many, tokenizer=tokenizer),
                              quarantine_url=join(where, f"{split}_quarantine.parquet"), storage=cfg.storage)
    if result.n_quarantined:
        log.warning("%s prompts: %d of %d rows quarantined (see %s)", split, result.n_quarantined,
                    result.n_rows, result.quarantine_url)
        return result.clean.reset_index(drop=True)
    return df
