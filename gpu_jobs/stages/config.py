"""The run config: one typed tree composed of each component's own config and the run's own
sections (sections.py).

    cfg = build_run_config({"rollout": {"n": 8}, "algorithm": {"adv_estimator": "rloo"}})

It lives below the stages, which read it; `flows/config.py` turns YAML files and verl-style
dotted overrides into the dict validated here. Defaults live only in the component classes.
Every field is validated before any work starts; errors name the dotted key and say why.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from gpu_jobs.algos.config import AlgorithmConfig, OverlongBufferConfig
from gpu_jobs.reward.config import RewardConfig
from gpu_jobs.reward.config import RewardModelConfig
from gpu_jobs.train.config import CriticConfig, ActorConfig
from storage.config import StorageConfig
from storage.fs import redact_url
from storage.layout import check_name, check_root
from gpu_jobs.data.gates import GateConfig
from gpu_jobs.data.generators import TIMES_TABLES
from gpu_jobs.stages.sections import (ARITH_PROBLEMS, AgreementConfig, AsyncConfig, DataConfig, LoopConfig, ModelConfig,
                                      PreferenceSection, RolloutStageConfig, SFTSection, TaskConfig, _Section)


SFT_HINT = "supervised fine-tuning is `sft: {}`, a section of its own (or any sft.* key; docs/guide/sft.md)"


class ConfigError(ValueError):
    """The run config is invalid; the message names each bad key."""


class RunConfig(_Section):
    run_id: str = Field("grpo-arith", description="Names the run's folder; the same id resumes the run.")
    root: str = Field(".rlmill", description="Storage root: a local folder, file://, memory:// or s3://bucket/prefix.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Endpoint and credentials of the root.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy to start from.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt datasets and sampling.")
    rollout: RolloutStageConfig = Field(default_factory=RolloutStageConfig, description="Response generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward scoring.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig,
                                            description="Model-based reward, its own stage (verl reward_model).")
    gate: GateConfig = Field(default_factory=GateConfig, description="Data-quality gates (great-expectations).")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage estimation and KL in reward.")
    overlong_buffer: OverlongBufferConfig = Field(
        default_factory=OverlongBufferConfig, description="DAPO soft overlong penalty (verl reward_model.overlong_buffer).")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy update (DeepSpeed).")
    critic: CriticConfig | None = Field(None, description="Value model for PPO/GAE; None = no critic.")
    preference: PreferenceSection | None = Field(
        None, description="Offline preference training (DPO / KTO on rated answers, no rollout); None = an RL "
        "run. `preference: {}` (or preference.algorithm=kto, ...) turns it on; see the section's keys.")
    sft: SFTSection | None = Field(
        None, description="Supervised fine-tuning on demonstrations (verl's SFT trainer, no rollout), the peer of "
        "preference (DPO/KTO); None = an RL run. `sft: {}` (or any sft.* key) turns it on; see the section's keys.")
    trainer: LoopConfig = Field(default_factory=LoopConfig, description="The iteration loop.")
    async_training: AsyncConfig = Field(default_factory=AsyncConfig, description="Rollout ahead of the update.")
    agreement: AgreementConfig = Field(default_factory=AgreementConfig,
                                       description="Trainer/rollout log-prob agreement probe.")
    tasks: TaskConfig = Field(default_factory=TaskConfig, description="Prefect task settings.")

    @field_validator("run_id")
    @classmethod
    def _run_id_is_one_folder(cls, v: str) -> str:
        return check_name(v, "run_id")

    @field_validator("root")
    @classmethod
    def _root_is_usable(cls, v: str) -> str:
        return check_root(v)

    @model_validator(mode="after")
    def _no_credentials_in_urls(self) -> "RunConfig":
        # Every URL is logged, shown in artifacts or frozen into run.json; the value is not echoed.
        for key, value in _string_leaves(self.model_dump()):
            if "://" in value and redact_url(value) != value:
                raise ValueError(f"{key} holds credentials ('user:secret@' in the URL): set storage.key/"
                                 "storage.secret or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY instead")
        return self

    @model_validator(mode="before")
    @classmethod
    def _grpo_by_default(cls, data: Any) -> Any:
        # verl defaults to gae, which needs a critic; rlmill's default run is critic-free GRPO.
        if isinstance(data, dict):
            algo = data.get("algorithm")
            if algo is None or (isinstance(algo, dict) and "adv_estimator" not in algo):
                data = {**data, "algorithm": {**(algo or {}), "adv_estimator": "grpo"}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _sft_is_a_section(cls, data: Any) -> Any:
        # Where a user looks for the list of algorithms, SFT is named: it is a section of its own.
        if isinstance(data, dict):
            algo, pref = data.get("algorithm"), data.get("preference")
            if (isinstance(algo, dict) and algo.get("adv_estimator") == "sft") or \
                    (isinstance(pref, dict) and pref.get("algorithm") == "sft"):
                raise ValueError(f"sft is neither an advantage estimator nor a preference algorithm: {SFT_HINT}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _one_temperature(cls, data: Any) -> Any:
        # The trainer must score tokens under the distribution they were sampled from; a second
        # field to keep equal by hand is how the PPO ratio silently stops being 1 on step one.
        if isinstance(data, dict) and isinstance(data.get("actor"), dict) and "temperature" in data["actor"]:
            raise ValueError("actor.temperature is not a setting: the trainer divides logits by "
                             "rollout.temperature (verl's way); set rollout.temperature only")
        return data

    @model_validator(mode="after")
    def _trainer_uses_rollout_temperature(self) -> "RunConfig":
        if self.rollout.temperature > 0 and self.actor.temperature != self.rollout.temperature:
            self.actor = self.actor.model_copy(update={"temperature": self.rollout.temperature})
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.rollout.temperature == 0:
            raise ValueError("rollout.temperature=0 samples greedily: every response of a group is the same and "
                             "the update has nothing to compare; use a temperature > 0 (validation is greedy anyway)")
        if self.algorithm.filter_groups.enable and self.algorithm.needs_reward_baselines:
            raise ValueError("algorithm.filter_groups (DAPO refill) with adv_estimator=remax is not supported: the "
                             "greedy baselines cover the first round's prompts only; drop one of the two")
        stale = self.async_training.staleness_threshold > 0
        if (stale or self.algorithm.rollout_correction.enabled) and not self.actor.recompute_old_logprobs:
            raise ValueError("async_training.staleness_threshold > 0 and algorithm.rollout_correction need the "
                             "trainer's own old log-probs: set actor.recompute_old_logprobs=true")
        if stale and self.algorithm.needs_reward_baselines:
            raise ValueError("adv_estimator=remax scores greedy baselines with the rollout engine's current weights, "
                             "which async_training makes stale: use another estimator or staleness_threshold=0")
        pp, ranks = self.actor.pipeline_parallel_size, self.trainer.n_gpus_per_node * self.trainer.nnodes
        if ranks % pp:
            raise ValueError(f"actor.pipeline_parallel_size={pp} splits the model over that many trainer ranks: "
                             f"trainer.n_gpus_per_node x trainer.nnodes ({ranks}) must be a multiple of it")
        if self.critic is not None and self.critic.pipeline_parallel_size > 1:
            raise ValueError("critic.pipeline_parallel_size > 1: the critic trains on one rank; set it to 1")
        if self.algorithm.needs_critic and self.critic is None:
            raise ValueError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs a critic: set critic: {{}} "
                             "(or critic.lr=...)")
        if self.actor.ppo_mini_batch_size > self.data.train_batch_size:
            raise ValueError(
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size}) is larger than "
                f"data.train_batch_size ({self.data.train_batch_size}); lower it or raise the batch")
        if self.algorithm.needs_groups and self.rollout.n < 2:
            raise ValueError(f"{self.algorithm.adv_estimator} compares responses within a group: set rollout.n >= 2")
        if self.data.generate == "arith" and not self.data.train_files \
                and self.data.train_size + max(self.data.val_size, 300) > ARITH_PROBLEMS:
            raise ValueError(f"data.train_size + held-out rows exceed the {ARITH_PROBLEMS} distinct arith "
                             "problems (a+b, a and b in 10..99): lower data.train_size")
        family = TIMES_TABLES.get(self.data.generate or "")
        if family and not self.data.val_files and self.data.val_size > family.max_held_out:
            raise ValueError(f"data.val_size={self.data.val_size}: {family.name} has {family.prompts} prompts in all "
                             f"and holds out at most {family.max_held_out} (whole facts, both orders); lower "
                             "data.val_size")
        if self.overlong_buffer.enable and not 0 < self.overlong_buffer.len <= self.rollout.max_response_length:
            raise ValueError("overlong_buffer.len must be in (0, rollout.max_response_length]")
        if self.trainer.placement == "remote":
            if self.trainer.checkpoint_every != 1:
                raise ValueError("placement=remote hands weights between processes through checkpoints: "
                                 "set trainer.checkpoint_every=1")
            # actor.recompute_old_logprobs is a remote stage of its own (on stage_deployment, beside
            # the update whose checkpoint it restores): async runs need it.
            if self.critic is not None or self.needs_ref or self.algorithm.needs_reward_baselines:
                raise ValueError("placement=remote runs critic-free runs without a reference model for now: "
                                 "drop critic / KL / remax, or use placement=colocated")
        if self.rollout.engine == "vllm" and self.rollout.temperature > 2.0:
            raise ValueError(f"rollout.temperature={self.rollout.temperature}: vLLM samples at temperatures in [0, 2]; "
                             "lower it or use rollout.engine=hf")
        if self.trainer.placement == "colocated":  # this process builds the engine: check it can (remote: the pool's)
            from gpu_jobs.rollout.base import check_parallelism

            check_parallelism(self.rollout.engine, self.rollout.engine_options)
        if self.rollout.engine == "vllm" and self.rollout.engine_options.dtype == "float16":
            raise ValueError("rollout.engine_options.dtype=float16 is not supported on CPU vLLM; use bfloat16")
        return self

    @model_validator(mode="after")
    def _lora_fits_the_trainer(self) -> "RunConfig":
        if self.model.lora_rank == 0:
            return self
        if isinstance(self.model.target_modules, list) and not self.model.target_modules:
            raise ValueError("model.target_modules is an empty list: name modules (e.g. [q_proj, v_proj]) "
                             "or use 'all-linear'")
        if self.trainer.n_gpus_per_node * self.trainer.nnodes > 1:
            raise ValueError("model.lora_rank > 0 trains on one trainer rank for now: set trainer.n_gpus_per_node=1 "
                             "(adapters are small), or model.lora_rank=0 for the multi-rank group")
        if self.actor.zero_stage == 3:
            raise ValueError("model.lora_rank > 0 with actor.zero_stage=3: adapters are added after the base model "
                             "is built, which ZeRO-3's partitioning does not cover; use actor.zero_stage=auto (0-2)")
        return self

    @model_validator(mode="after")
    def _reward_model_fits_the_run(self) -> "RunConfig":
        if not self.reward_model.enable:
            return self
        if self.algorithm.filter_groups.enable:
            raise ValueError("reward_model.enable with algorithm.filter_groups: the DAPO filter decides on rule "
                             "scores before the reward-model stage runs; drop one of the two")
        if self.algorithm.needs_reward_baselines:
            raise ValueError("reward_model.enable with adv_estimator=remax: the greedy baselines are scored by the "
                             "rule alone; use another estimator or reward_model.enable=false")
        if self.trainer.placement == "remote":
            raise ValueError("reward_model.enable runs the reward model in the flow process, which placement=remote "
                             "keeps free of models: use trainer.placement=colocated")
        return self

    @model_validator(mode="after")
    def _preference_fits_the_run(self) -> "RunConfig":
        # Keys of the RL loop that would be silently ignored by a preference run, or that the
        # preference update cannot honour yet, are refused by name.
        pref = self.preference
        if pref is None:
            return self
        refused = [(self.data.train_files or self.data.val_files, "data.train_files/val_files name prompt datasets "
                    "for rollouts: put preference data in preference.train_files / preference.val_files"),
                   (self.critic is not None, "critic: a preference run has no values; remove the critic section"),
                   (self.actor.kl_loss.use_kl_loss or self.algorithm.use_kl_in_reward,
                    "actor.kl_loss / algorithm.use_kl_in_reward: DPO and KTO hold their pull toward the reference "
                    "in preference.beta; turn those off"),
                   (self.reward_model.enable, "reward_model.enable: a preference run scores nothing; turn it off"),
                   (self.actor.entropy_coeff != 0, "actor.entropy_coeff: the preference loss has no entropy term; set 0"),
                   (self.actor.use_dynamic_bsz, "actor.use_dynamic_bsz: preference micro-batches hold whole pairs, "
                    "ppo_micro_batch_size_per_gpu of them; set it to false"),
                   (self.rollout.temperature != 1.0, "rollout.temperature: preference log-probs are taken at "
                    "temperature 1 (TRL's); leave rollout.temperature at 1"),
                   (self.trainer.placement != "colocated" or self.trainer.n_gpus_per_node * self.trainer.nnodes > 1
                    or self.actor.pipeline_parallel_size > 1,
                    "trainer.placement=remote, several trainer ranks or a pipeline: preference runs train on one "
                    "colocated rank for now; use the defaults"),
                   (self.async_training.staleness_threshold > 0, "async_training: there is no rollout to run ahead")]
        for bad, why in refused:
            if bad:
                raise ValueError(f"preference ({pref.algorithm}) with {why}")
        if pref.algorithm == "kto" and min(self.data.train_batch_size, self.actor.ppo_micro_batch_size_per_gpu) < 2:
            raise ValueError("preference.algorithm=kto estimates its KL reference point from mismatched pairs within a "
                             "micro-batch: data.train_batch_size and actor.ppo_micro_batch_size_per_gpu must be >= 2")
        if not pref.train_files and pref.generate is None:
            raise ValueError("preference.train_files is empty and preference.generate is null: name a preference file "
                             "or set preference.generate=arith")
        return self

    @model_validator(mode="after")
    def _sft_fits_the_run(self) -> "RunConfig":
        # As for preference runs: RL keys an SFT run would silently ignore, or its update cannot
        # honour yet, are refused by name.
        sft = self.sft
        if sft is None:
            return self
        refused = [(self.preference is not None, "preference: a run trains one way; chain two runs instead "
                    "(the second's model.path = the first's checkpoints/<k>/policy, docs/guide/sft.md)"),
                   (self.data.train_files or self.data.val_files, "data.train_files/val_files name prompt datasets "
                    "for rollouts: put demonstrations in sft.train_files / sft.val_files"),
                   (self.critic is not None, "critic: an SFT run has no values; remove the critic section"),
                   (self.actor.kl_loss.use_kl_loss or self.algorithm.use_kl_in_reward,
                    "actor.kl_loss / algorithm.use_kl_in_reward: an SFT run has no reference model; turn those off"),
                   (self.reward_model.enable, "reward_model.enable: an SFT run scores nothing; turn it off"),
                   (self.actor.entropy_coeff != 0, "actor.entropy_coeff: the SFT loss has no entropy term; set 0"),
                   (self.rollout.temperature != 1.0, "rollout.temperature: SFT log-probs are taken at temperature 1 "
                    "(verl's and TRL's); leave rollout.temperature at 1"),
                   (self.trainer.placement != "colocated" or self.trainer.n_gpus_per_node * self.trainer.nnodes > 1
                    or self.actor.pipeline_parallel_size > 1,
                    "trainer.placement=remote, several trainer ranks or a pipeline: SFT runs train on one colocated "
                    "rank for now (ZeRO-3 included); use the defaults"),
                   (self.async_training.staleness_threshold > 0, "async_training: there is no rollout to run ahead"),
                   (not sft.train_files and sft.generate is None, "sft.train_files empty and sft.generate null: name "
                    "a demonstrations file or set sft.generate=arith")]
        for bad, why in refused:
            if bad:
                raise ValueError(f"sft with {why}")
        return self

    @property
    def offline(self) -> bool:
        """Whether the run trains on a dataset (preference: DPO/KTO, or sft) instead of rollouts:
        no rollout engine, no reward, no agreement probe."""
        return self.preference is not None or self.sft is not None

    @property
    def update_table_stage(self) -> str:
        """The stage whose committed table the update trains on (and a resume replays from)."""
        return "preference_ref" if self.preference is not None else "sft_batch" if self.sft is not None \
            else "advantages"

    @property
    def needs_ref(self) -> bool:
        return self.algorithm.use_kl_in_reward or self.actor.kl_loss.use_kl_loss or self.preference is not None

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether actor.recompute_old_logprobs is served by the update's own forward (TRL's way)
        instead of a logprobs-stage pass: the update is one optimizer step over the whole batch
        (ppo_epochs 1, one mini-batch), so the weights that score each micro-batch are the ones a
        separate pass would use. Not when something before the update reads old_logprobs (rollout
        correction, KL in the reward), nor for stale batches (async) or a pipeline, which keep their
        measured path. On SmolLM2 (8 x 4 x 128) the separate pass was ~13% of an iteration."""
        a = self.actor
        return (a.recompute_old_logprobs and a.ppo_epochs == 1
                and a.ppo_mini_batch_size >= self.data.train_batch_size and a.pipeline_parallel_size == 1
                and not self.algorithm.rollout_correction.enabled and not self.algorithm.use_kl_in_reward
                and self.async_training.staleness_threshold == 0)

    @property
    def old_logprobs_in_stage(self) -> bool:
        """Whether the logprobs stage commits old_logprobs (recomputed, not from the update)."""
        return self.actor.recompute_old_logprobs and not self.old_logprobs_from_update


def _string_leaves(node: Any, prefix: str = ""):
    """(dotted key, value) of every str in a nested dict/list dump."""
    if isinstance(node, str):
        yield prefix, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _string_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _string_leaves(v, f"{prefix}[{i}]")


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _submodels(arg)]


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the run config, sections included (``rollout``, ``rollout.n``, ...)."""
    keys = []
    for name, field in (model or RunConfig).model_fields.items():
        key = prefix + (field.alias or name)
        keys.append(key)
        for sub in _submodels(field.annotation):
            keys += config_keys(sub, key + ".")
    return keys


def unknown_key_message(key: str) -> str:
    """What to say about a key the config does not have: the closest valid key ("did you mean
    rollout.n?"), looked up among its siblings first, then among every key."""
    import difflib

    valid = config_keys()
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in valid if k.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.6)
    guess = (f"{parent}.{near[0]}" if parent else near[0]) if near else None
    if guess is None:
        near = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
        guess = near[0] if near else None
    hint = f"did you mean {guess}?" if guess else "check the spelling;"
    return f"unknown key ({hint} `rlmill config show` lists every key)"


def _format_validation_error(exc: ValidationError) -> str:
    """One line per problem, naming the dotted key (an unknown key: see unknown_key_message)."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = unknown_key_message(key)
        elif key in ("algorithm.adv_estimator", "preference.algorithm"):
            msg += f"; {SFT_HINT}"
        lines.append(f"  {key}: {msg}")
    return "invalid run config:\n" + "\n".join(lines)


def build_run_config(data: dict[str, Any], check_files: bool = True) -> RunConfig:
    """Validate `data`; check_files=False skips checks that local files exist (see config_from_run_json)."""
    try:
        return RunConfig.model_validate(data, context={"check_files": check_files})
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def config_from_run_json(frozen: dict[str, Any]) -> RunConfig:
    """The RunConfig a run was frozen with. Secrets are masked in run.json, so storage
    credentials come from this process's environment (AWS_* variables), as on a cluster."""
    data = dict(frozen["config"])
    data["storage"] = {k: v for k, v in data.get("storage", {}).items() if k not in ("key", "secret", "token")}
    # The trainer's temperature is derived from rollout.temperature, never a setting of its own.
    data["actor"] = {k: v for k, v in data.get("actor", {}).items() if k != "temperature"}
    # The files were checked when the run was created, maybe on another machine.
    return build_run_config(data, check_files=False)


def frozen_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as written to run.json: secrets stay masked (SecretStr dumps as '**********');
    actor.temperature is left out (it is rollout.temperature, derived on load)."""
    return cfg.model_dump(mode="json", exclude={"actor": {"temperature"}})
