"""What a run's stages share: the frozen config, its storage layout, the prompts, and the warm
engines (trainer, reference model, critic, rollout engine) kept loaded across iterations.

    ctx = RunContext.open(cfg)        # run.json, datasets, model folder, tokenizer: cheap
    ctx.warm()                        # builds the DeepSpeed trainer and the rollout engine
    ctx.restore()                     # trainer/engine weights = state after the last committed update

Colocated placement keeps one RunContext per run in the flow process (see tasks/context.py);
a stage that runs anywhere else rebuilds it from storage with `RunContext.open(run.json)`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from storage import ObjectExistsError, RunLayout, committed, join, read_manifest
from storage.datasets import PromptSampler, make_dataset, read_prompts

if TYPE_CHECKING:
    from flows.config import RunConfig

log = logging.getLogger("rlmill")

# Keys that may differ between the frozen run.json and a resuming invocation: extending a run,
# or changing how often it reports, does not change what any committed stage computed.
RESUMABLE_KEYS = {("trainer", "total_iterations"), ("trainer", "val_every"), ("trainer", "samples_in_artifact"), ("trainer", "loggers"),
                  ("trainer", "tensorboard"), ("tasks", "retries"), ("tasks", "retry_delay_seconds"),
                  ("tasks", "timeout_seconds")}


class RunConfigMismatchError(ValueError):
    """A run id was reused with a config that would change what its committed stages mean."""


def _diff(a: Any, b: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key), b.get(key), prefix + (key,))
        return out
    return [] if a == b else [prefix]


def resolve_model(path: str, seed: int, storage: Any) -> str:
    """ModelConfig.path -> a local HF folder."""
    from gpu_jobs.models import ensure_builtin_model, ensure_smollm2
    from gpu_jobs.models.loading import resolve_model_path

    if path == "builtin":
        return ensure_builtin_model(seed=seed)
    if path == "smollm2":
        return ensure_smollm2()
    return resolve_model_path(path, storage)


@dataclass
class RunContext:
    cfg: "RunConfig"
    layout: RunLayout
    run_uid: str
    model_path: str
    tokenizer: Any
    train: Any  # pandas DataFrame of verl rows
    val: Any
    sampler: PromptSampler
    trainer: Any = None
    ref: Any = None
    critic: Any = None
    engine: Any = None
    trainer_k: int = 0  # the iteration whose update the trainer's weights include (0 = none yet)
    kl_ctrl: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def storage(self):
        return self.cfg.storage

    # ---------------------------------------------------------------- setup (no model weights)
    @classmethod
    def open(cls, cfg: "RunConfig") -> "RunContext":
        from flows.config import frozen_config
        from gpu_jobs.models import load_tokenizer

        layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
        train_urls, val_urls = _datasets(cfg)
        train = read_prompts(train_urls, storage=cfg.storage)
        val = read_prompts(val_urls, storage=cfg.storage).iloc[: cfg.data.val_size].reset_index(drop=True)
        model_path = resolve_model(cfg.model.path, cfg.model.seed, cfg.storage)
        tokenizer = load_tokenizer(model_path)
        # Gate the prompts before the run exists: bad data fails here, naming rows, with nothing
        # of the run written but the gate's own report.
        train = _prompts_within_length(cfg, "train", train, tokenizer)
        val = _prompts_within_length(cfg, "val", val, tokenizer)
        train = _gate_prompts(cfg, layout, "train", train, tokenizer)
        val = _gate_prompts(cfg, layout, "val", val, tokenizer)
        run_uid = _freeze(layout, frozen_config(cfg))
        sampler = PromptSampler(seed=cfg.data.seed, batch_size=cfg.data.train_batch_size, n_rows=len(train))
        ctx = cls(cfg, layout, run_uid, model_path, tokenizer, train, val, sampler)
        ctx.kl_ctrl = _kl_controller(cfg)
        return ctx

    @classmethod
    def from_storage(cls, root: str, run_id: str) -> "RunContext":
        """The context of an existing run, from its run.json alone (a process that did not start
        the run: a retried task on a fresh worker, a remote stage). Storage credentials come
        from this process's AWS_* environment; run.json never holds them."""
        from flows.config import config_from_run_json

        frozen = RunLayout(root, run_id).read_run_json()
        if frozen is None:
            raise RuntimeError(f"no run {run_id!r} under {root}: start it with `rlmill train` first")
        return cls.open(config_from_run_json(frozen))

    # ---------------------------------------------------------------- warm engines
    def warm(self, *, trainer: bool = True, engine: bool = True) -> None:
        """Load the trainer (and ref/critic when the algorithm needs them) and the rollout engine."""
        from gpu_jobs.rollout import get_rollout_engine
        from gpu_jobs.train import Critic, PolicyTrainer, RefModel

        cfg = self.cfg
        if engine and self.engine is None:
            self.engine = get_rollout_engine(cfg.rollout.engine, self.model_path, cfg.rollout.engine_options,
                                             storage=cfg.storage)
        if not trainer:
            return
        if self.trainer is None:
            # The logprobs stage commits old_logprobs when asked to; the trainer must not redo it.
            actor = cfg.actor.model_copy(update={"recompute_old_logprobs": False})
            self.trainer = PolicyTrainer(self.model_path, actor, tokenizer=self.tokenizer, storage=cfg.storage)
        if cfg.needs_ref and self.ref is None:
            self.ref = RefModel(self.model_path, cfg.actor, tokenizer=self.tokenizer, storage=cfg.storage)
        if cfg.critic is not None and self.critic is None:
            self.critic = Critic(self.model_path, cfg.critic, tokenizer=self.tokenizer, storage=cfg.storage)

    def load_policy_into_engine(self, k: int) -> None:
        """Remote placement: the rollout engine takes the weights checkpointed after update k."""
        if k > 0:
            self.engine.update_weights(self.layout.policy(k))
        self.trainer_k = k

    def restore(self) -> int:
        """Bring the trainer to the state after the last committed update; returns that iteration.

        Loads the newest checkpoint (weights, optimizer, RNG, data cursor) and replays the
        committed updates after it from their committed batches: updates are deterministic given
        that state, so the weights equal those of a run that never stopped. A checkpoint damaged
        after it was published (a file missing or failing its checksum) is skipped for the next
        older one, down to the start model, with more updates replayed.
        """
        from gpu_jobs.stages.iteration import replay_update

        last = last_committed(self.layout, "update")
        ckpt = self.layout.latest_checkpoint()
        if ckpt is not None and ckpt > self.trainer_k:
            self._load_checkpoint(ckpt)
        for k in range(self.trainer_k + 1, last + 1):
            log.info("replaying committed update of iteration %d", k)
            replay_update(self, k)
        if self.trainer_k > 0:
            self._restore_kl_ctrl()
            if self.engine is not None:
                self.engine.update_weights(self.trainer.gathered_state_dict())
        return self.trainer_k

    def _load_checkpoint(self, newest: int) -> None:
        """Load the newest intact checkpoint <= `newest` into the trainer (and critic)."""
        from gpu_jobs.train.checkpoint import STATE_FILE
        from storage import CorruptShardError

        # Each load checks every file before it touches a weight; only a damaged critic after
        # a good policy load leaves a half-loaded pair, which an older checkpoint overwrites.
        half_loaded = False
        for k in range(newest, self.trainer_k, -1):
            if not _exists(join(self.layout.trainer(k), "trainer", STATE_FILE), self.storage):
                continue  # never checkpointed there, or the save did not finish
            critic = join(self.layout.checkpoint(k), "critic")
            log.info("resuming %s from checkpoint %d", self.cfg.run_id, k)
            try:
                self.trainer.load(self.layout.trainer(k))
                half_loaded = self.critic is not None
                if self.critic is not None and _exists(critic, self.storage):
                    self.critic.load(critic)
            except CorruptShardError as e:
                log.warning("checkpoint %d of %s is damaged (%s); trying an older one", k, self.cfg.run_id, e)
                continue
            self.trainer_k = k
            return
        if half_loaded:  # back to the start model's weights before replaying from it
            self.trainer = self.critic = None
            self.warm(engine=False)
        log.warning("no intact checkpoint of %s at or below %d: replaying committed updates from the start model",
                    self.cfg.run_id, newest)

    def _restore_kl_ctrl(self) -> None:
        uri = committed(self.layout.stage(self.trainer_k, "advantages"), self.storage)
        state = read_manifest(uri, self.storage).metrics.get("kl_ctrl_state") if uri else None
        if state:
            self.kl_ctrl.load_state_dict(state)

    def close(self) -> None:
        self.trainer = self.ref = self.critic = self.engine = None


def last_committed(layout: RunLayout, stage: str, limit: int = 1_000_000) -> int:
    """Highest k >= 1 whose `stage` committed, scanning up from 1 (0 when none)."""
    k = 0
    while k < limit and committed(layout.stage(k + 1, stage), layout.storage):
        k += 1
    return k


def _exists(url: str, storage: Any) -> bool:
    from storage import url_to_fs

    fs, path = url_to_fs(url, storage)
    return fs.exists(path)


def _freeze(layout: RunLayout, config: dict) -> str:
    """Write run.json once; on a resume, check the config still matches. Returns the run's uid.

    The uid is minted when the run is first created: a run deleted and started again under the
    same id is a different run, and Prefect cache keys include the uid so they never cross.
    """
    try:
        uid = uuid.uuid4().hex
        layout.write_run_json({"run_uid": uid, "created_at": time.time(), "config": config})
        return uid
    except ObjectExistsError:
        pass
    frozen = layout.read_run_json() or {}
    changed = [d for d in _diff(frozen.get("config", {}), json.loads(json.dumps(config, default=str)))
               if d[:2] not in RESUMABLE_KEYS]
    if changed:
        keys = ", ".join(".".join(map(str, d)) for d in changed[:8])
        raise RunConfigMismatchError(
            f"run {layout.run_id!r} already exists under {layout.root_url} with a different config "
            f"({keys}); resume it with the same config, or start a new run with another run_id")
    return frozen["run_uid"]


def _datasets(cfg: "RunConfig") -> tuple[list[str], list[str]]:
    data = cfg.data
    if data.train_files:
        return list(data.train_files), list(data.val_files or data.train_files)
    if data.generate is None:
        raise ValueError("data.train_files is empty and data.generate is null: name a dataset or files")
    out = join(cfg.root, "datasets", f"{data.generate.replace(':', '-')}-seed{data.seed}-n{data.train_size}")
    train_url, test_url = join(out, "train.parquet"), join(out, "test.parquet")
    if not (_exists(train_url, cfg.storage) and _exists(test_url, cfg.storage)):
        make_dataset(data.generate, out, train_size=data.train_size, test_size=max(data.val_size, 300),
                     seed=data.seed, storage=cfg.storage)
    return [train_url], list(data.val_files or [test_url])


def _prompts_within_length(cfg: "RunConfig", split: str, df: Any, tokenizer: Any) -> Any:
    """data.overlong_prompts: 'error' refuses a prompt longer than data.max_prompt_length (naming
    its row) before anything of the run is written; 'filter' drops such rows and says how many
    (verl's filter_overlong_prompts)."""
    from storage.datasets import OverlongPromptError, render_prompts

    try:
        _, kept, n_filtered = render_prompts(df[cfg.data.prompt_key].tolist(), tokenizer, cfg.data)
    except OverlongPromptError as e:
        raise OverlongPromptError(f"{split} prompts: {e}") from None
    if not n_filtered:
        return df
    log.warning("%s prompts: dropped %d of %d longer than data.max_prompt_length=%d (data.overlong_prompts=filter)",
                split, n_filtered, len(df), cfg.data.max_prompt_length)
    if not kept:
        raise OverlongPromptError(f"every {split} prompt is longer than data.max_prompt_length="
                                  f"{cfg.data.max_prompt_length}: raise it")
    return df.iloc[kept].reset_index(drop=True)


def _gate_prompts(cfg: "RunConfig", layout: RunLayout, split: str, df: Any, tokenizer: Any) -> Any:
    """great-expectations suite over a prompt dataset; quarantined rows are counted and written."""
    from storage.quality import validate_prompts

    gate = cfg.gate.model_copy(update={"max_prompt_length": cfg.data.max_prompt_length})
    where = join(layout.root, "data_gate")
    result = validate_prompts(df, gate, join(where, f"{split}_report.json"), tokenizer=tokenizer,
                              quarantine_url=join(where, f"{split}_quarantine.parquet"), storage=cfg.storage)
    if result.n_quarantined:
        log.warning("%s prompts: %d of %d rows quarantined (see %s)", split, result.n_quarantined,
                    result.n_rows, result.quarantine_url)
        return result.clean.reset_index(drop=True)
    return df


def _kl_controller(cfg: "RunConfig"):
    from gpu_jobs.algos import AdaptiveKLController, FixedKLController

    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(init_kl_coef=k.kl_coef, target_kl=k.target_kl, horizon=k.horizon)
    return FixedKLController(kl_coef=k.kl_coef)
