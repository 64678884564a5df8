"""The run config's own sections (model, data, rollout, trainer loop, agreement, async, tasks):
the ones no component owns. `config.py` composes them with each component's config into RunConfig.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpu_jobs.algos.preference import PreferenceConfig
from gpu_jobs.rollout.agent_loop import MultiTurnConfig
from gpu_jobs.rollout.base import RolloutEngineConfig, SamplingConfig
from gpu_jobs.train.config import ActorConfig
from gpu_jobs.data import DatasetConfig
from gpu_jobs.data.generators import dataset_names
from gpu_jobs.models.loading import MODEL_ALIASES
from storage.layout import check_name


ARITH_PROBLEMS = 90 * 90


class _Section(BaseModel):
    # A rejected input may hold storage secrets: pydantic must not echo it in its error text.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class ModelConfig(_Section):
    path: str = Field(
        "builtin",
        description="; ".join(f"'{name}': {alias.what}" for name, alias in MODEL_ALIASES.items())
        + "; or an HF folder / storage URL.",
    )
    seed: int = Field(0, description="Seed of a built alias's initialisation and warm-up ('builtin', "
                      "'builtin-tools', 'smollm2-tools'; each seed is built and cached once).")
    lora_rank: int = Field(
        0, ge=0, description="LoRA rank r (verl's name); 0 = full fine-tuning. > 0: peft adapters on "
        "target_modules train and every base weight stays frozen (the optimizer holds the adapters only); "
        "the rollout engine gets base + B@A*lora_alpha/r merged, checkpoints' policy folders hold the "
        "adapter plus a pointer to model.path, and the KL reference is the actor with its adapter off. "
        "One trainer rank, ZeRO stage 0-2. The critic, if any, still trains in full.")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator (verl's name): the update is "
                              "B@A * lora_alpha / lora_rank.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get adapters (verl's name): 'all-linear' (every nn.Linear "
        "but the output head) or a list of module names, e.g. [q_proj, v_proj]. Used when lora_rank > 0.")


class DataConfig(DatasetConfig):
    generate: str | None = Field(
        "arith",
        description="Built-in dataset generated into the run's storage when train_files is empty: "
        f"{' | '.join(dataset_names())}. Ignored when train_files is set.",
    )
    train_size: int = Field(7000, ge=1, description="Rows generated for the built-in train split (arith has 8100 distinct problems in all).")
    val_size: int = Field(300, ge=1, description="Rows of the held-out set used for validation.")
    train_batch_size: int = Field(16, ge=1, description="Prompts per iteration (verl data.train_batch_size).")
    seed: int = Field(0, description="Seed of prompt sampling: batch k is a pure function of (seed, epoch, k).")

    @field_validator("generate")
    @classmethod
    def _generate_names_one_folder(cls, v: str | None) -> str | None:
        # The name becomes a folder under <root>/datasets: 'rg:../../x' must not climb out of it.
        try:
            check_name(v.replace(":", "-"), "data.generate") if v is not None else None
        except ValueError:
            raise ValueError(f"data.generate {v!r} must be one of {' | '.join(dataset_names())}, the task "
                             "named with letters, digits, '.', '_' or '-'") from None
        return v


class ValKwargs(_Section):
    """Sampling for validation (verl's `rollout.val_kwargs`): n responses per held-out prompt."""

    n: int = Field(1, ge=1, description="Responses per validation prompt; N of the val-core mean@N/best@N/maj@N metrics.")
    do_sample: bool = Field(False, description="Sample with temperature/top_p/top_k; false = greedy decoding "
                            "(then n must be 1: greedy responses are all the same).")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature when do_sample (then > 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass when do_sample.")
    top_k: int = Field(-1, ge=-1, description="Top-k when do_sample; -1 = off.")

    @model_validator(mode="after")
    def _sampling_is_consistent(self) -> "ValKwargs":
        if not self.do_sample and self.n > 1:
            raise ValueError(f"rollout.val_kwargs.n={self.n} with do_sample=false gives {self.n} identical greedy "
                             "responses: set rollout.val_kwargs.do_sample=true and a temperature > 0, or n=1")
        if self.do_sample and self.temperature == 0:
            raise ValueError("rollout.val_kwargs.do_sample=true needs rollout.val_kwargs.temperature > 0 "
                             "(0 is greedy: set do_sample=false)")
        return self

    def sampling(self, max_response_length: int, seed: int) -> SamplingConfig:
        """Greedy unless do_sample; `seed` makes a retried validation draw the same responses."""
        if not self.do_sample:
            return SamplingConfig(temperature=0.0, max_response_length=max_response_length, seed=seed)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_response_length=max_response_length, seed=seed)


class RolloutStageConfig(_Section):
    engine: str = Field("hf", description="Rollout backend: a name registered in gpu_jobs.rollout.ROLLOUT_ENGINES "
                        "(built in: 'hf' (transformers), 'vllm').")
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 = off.")
    max_response_length: int = Field(8, ge=1, description="Most tokens generated per response.")
    ignore_eos: bool = Field(
        False, description="Keep sampling past EOS to max_response_length (verl rollout.ignore_eos): "
        "fixes response length for benchmarks; not for training. Greedy decoding (validation) still stops.")
    engine_options: RolloutEngineConfig = Field(default_factory=RolloutEngineConfig, description="Backend settings.")
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs, description="Validation sampling (verl rollout.val_kwargs).")
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="Multi-turn rollouts with tools (verl rollout.multi_turn).")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        from gpu_jobs.rollout import ROLLOUT_ENGINES  # the package registers the built-in engines

        ROLLOUT_ENGINES[v]  # raises, listing the valid names
        return v

    @model_validator(mode="after")
    def _multi_turn_fits(self) -> "RolloutStageConfig":
        mt = self.multi_turn
        if not mt.enable:
            return self
        if self.ignore_eos:
            raise ValueError("rollout.multi_turn ends each model turn at EOS: set rollout.ignore_eos=false")
        if self.max_response_length < 2 * mt.max_assistant_turns:
            raise ValueError(f"rollout.max_response_length={self.max_response_length} covers all turns and tool "
                             f"answers together: raise it well above multi_turn.max_assistant_turns")
        if self.engine == "vllm" and self.temperature != 1.0:
            raise ValueError("rollout.multi_turn with rollout.engine=vllm needs rollout.temperature=1 (vLLM scores "
                             "the tool turns' tokens at temperature 1); use rollout.engine=hf for other temperatures")
        return self

    def sampling(self, seed: int) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_response_length=self.max_response_length, seed=seed,
                              ignore_eos=self.ignore_eos)

    def greedy(self) -> SamplingConfig:
        return SamplingConfig(temperature=0.0, max_response_length=self.max_response_length, seed=0)


class LoopConfig(_Section):
    total_iterations: int = Field(40, ge=1, description="RL iterations in the run (verl total_training_steps).")
    val_every: int = Field(10, ge=0, description="Validate every this many iterations (0 = only before and after).")
    val_before_train: bool = Field(True, description="Validate before the first iteration (verl's "
                                   "trainer.val_before_train); false skips that pass (minutes on a real model), and "
                                   "the run's summary then has no 'before' score.")
    checkpoint_every: int = Field(10, ge=1, description="Write policy weights + trainer state every this many iterations.")
    placement: Literal["colocated", "remote"] = Field(
        "colocated", description="Where GPU stages run. 'colocated': in the flow process with warm roles. "
        "'remote': rollout, update and validation run as runs of the stage deployment on its work pool, "
        "handing weights over through checkpoints in storage.")
    n_gpus_per_node: int = Field(
        1, ge=1, description="Trainer ranks (verl's name; on CPU, processes). > 1 starts a warm group of DeepSpeed "
        "ranks with torchrun on the first update and keeps it for the run: ZeRO-3 partitions parameters, "
        "gradients and optimizer state across them; the reference model and critic stay on one rank.")
    nnodes: int = Field(
        1, ge=1, description="Nodes of the trainer group, n_gpus_per_node ranks each (verl's name). The process "
        "running the update (the flow's, or the remote update's with placement=remote) is node 0; every other "
        "node joins with `python -m gpu_jobs.train.ranks.launch --nnodes M --node-rank i ...` (docs/guide/ranks.md, 'Several nodes').")
    master_addr: str = Field(
        "", description="With nnodes > 1: the address of node 0 that the other nodes' launchers reach. "
        "Empty = $MASTER_ADDR of the process that runs the update (e.g. a work pool's job variable).")
    master_port: int = Field(
        0, ge=0, le=65535, description="With nnodes > 1: node 0's rendezvous port. 0 = $MASTER_PORT of the "
        "process that runs the update.")
    stage_deployment: str = Field(
        "rl-stage/gpu", description="With placement=remote: the deployment (flow/deployment) that runs GPU stages: "
        "the update and the trainer's log-prob pass, and rollout/validation too unless rollout_deployment names another.")
    rollout_deployment: str = Field(
        "", description="With placement=remote: the deployment that runs rollout and validation (both generate "
        "with the rollout engine from published checkpoints), e.g. 'rl-stage/rollout' on its own work pool, so "
        "an async run (async_training.staleness_threshold > 0) samples on one pool while the update trains on "
        "another. Empty = trainer.stage_deployment.")
    samples_in_artifact: int = Field(4, ge=0, description="Prompts/responses shown in each iteration's markdown artifact.")
    tensorboard: bool = Field(True, description="Also write metrics as TensorBoard events under the run's folder.")
    loggers: list[Literal["wandb", "mlflow"]] = Field(
        default_factory=list, description="Extra metric loggers: 'wandb' and/or 'mlflow' (their packages must be "
        "installed; `make test` installs the pinned ones). One tracker run per rlmill run: the frozen config as "
        "params, each iteration's metrics at step = iteration, a summary and the curves at the end, FAILED when "
        "the run fails; a resumed run continues it. MLflow logs to $MLFLOW_TRACKING_URI (unset: MLflow's "
        "default, ./mlflow.db), experiment $MLFLOW_EXPERIMENT_NAME or 'rlmill'; W&B to project $WANDB_PROJECT "
        "or 'rlmill', offline with WANDB_MODE=offline (files under $WANDB_DIR).")

    def deployment_for(self, pool: Literal["trainer", "rollout"]) -> str:
        """The deployment of a pool (a stage's declared `where`): generation on rollout_deployment
        (if set), the trainer's stages (update, log-probs) on stage_deployment."""
        return (self.rollout_deployment or self.stage_deployment) if pool == "rollout" else self.stage_deployment

    @model_validator(mode="after")
    def _loggers_installed(self) -> "LoopConfig":
        import importlib.util

        for name in self.loggers:
            if importlib.util.find_spec(name) is None:
                # Not a bare `pip install mlflow`: full mlflow pins pyarrow below the environment's.
                raise ValueError(f"trainer.loggers names {name!r} but it is not installed: "
                                 f"`bash scripts/ensure_venv.sh test` installs the tested versions (the `test` "
                                 f"extra of pyproject.toml: mlflow-skinny, wandb), or remove it")
        return self


class AgreementConfig(_Section):
    """The trainer/rollout agreement probe (gpu_jobs/stages/agreement.py)."""

    max_probs_diff_mean: float | None = Field(
        None, ge=0, description="Fail the iteration, before its update commits, when the mean "
        "|p_rollout - p_trainer| over the probed tokens (training/rollout_probs_diff_mean) passes this. "
        "None = 1e-3 when both engines run fp32 and 3e-2 when either runs bf16 (measured: two bf16 engines "
        "sit ~1e-2 apart on SmolLM2, docs/guide/agreement.md); with top_k/top_p sampling the "
        "rollout's log-probs are of the filtered distribution, so None then only reports. "
        "Set a large value to report without failing.")
    in_update: bool = Field(
        True, description="Probe with the update's own forwards: every response of its first (shuffled) "
        "mini-batch, compared and checked before that mini-batch's optimizer step, with no forward pass of its "
        "own. Used when the trainer runs in the stage's process (one rank, no pipeline) at ZeRO stage 0 "
        "without dropout; otherwise, or with false, the probe is a separate forward over `rows` responses.")
    rows: int = Field(64, ge=0, description="Responses of each batch the trainer re-scores in a separate forward "
                      "for the probe, when the update does not probe itself (agreement.in_update) and the "
                      "logprobs stage did not already re-score them (0 = all). Also the probe at run start and "
                      "after a resume.")

    def threshold(self, rollout: "RolloutStageConfig", actor: ActorConfig) -> float | None:
        if self.max_probs_diff_mean is not None:
            return self.max_probs_diff_mean
        if rollout.top_k > 0 or rollout.top_p < 1.0:
            return None
        # Both engines load their own weights in their own dtype (the hf engine too), so either
        # one in bf16 brings its rounding: ~1e-2 between two bf16 engines on SmolLM2, where a
        # trainer at temperature 1.0 against a 0.8 rollout is 6e-2 (benchmarks/bench_agreement.py).
        fp32 = actor.dtype == "fp32" and rollout.engine_options.dtype == "float32"
        return 1e-3 if fp32 else 3e-2


class AsyncConfig(_Section):
    """Asynchronous RL (verl's `async_training`): rollout runs ahead of the update."""

    staleness_threshold: int = Field(
        0, ge=0, description="s: the rollout of iteration k samples with the weights after update k-1-s "
        "(0 = the synchronous loop; 1 = one-step-off-policy: rollout k+1 runs while update k runs). The "
        "schedule is a pure function of s, so resume stays exact; stale samples are corrected by "
        "algorithm.rollout_correction.")

    def weights_version(self, k: int) -> int:
        """The update whose weights the rollout of iteration k samples with (0 = the start model)."""
        return max(0, k - 1 - self.staleness_threshold)


class TaskConfig(_Section):
    retries: int = Field(2, ge=0, description="Prefect retries of each stage task (stages are idempotent).")
    retry_delay_seconds: float | list[float] = Field(
        default_factory=lambda: [10.0, 40.0, 160.0],
        description="Wait before each retry of a failed stage task: one number for every retry, or a "
        "list (retry i waits entry i; the last entry repeats; at most 50). The default [10, 40, 160] "
        "backs off x4: transient storage faults are already waited out inside the task (up to "
        "storage.retry_budget_seconds, 5 min), so what reaches a task retry is an outage longer "
        "than that or another transient failure (an engine, a worker, the Prefect API). 10 s rides "
        "out a blip, 40 s a service restart, and every attempt waits out storage for 5 min more; "
        "a task that fails for good costs 50 s more with the default 2 retries. 0 = immediately "
        "(all retries then fall inside the same outage).")
    timeout_seconds: float | None = Field(None, gt=0, description="Per-task timeout; None = none.")
    # The next four are left out of run.json (exclude=True): they say how the run is operated, not
    # what a stage computes, so a run frozen without them resumes and they may change between starts.
    api_outage_budget_seconds: float = Field(
        600.0, ge=0, exclude=True, description="How long a run waits for an unreachable Prefect API (server restarted or "
        "down) before it gives up: the run probes the API with backoff (1 s doubling to 10 s, jittered) and, "
        "once it answers, re-runs the interrupted iteration in the same process, where committed stages are "
        "not recomputed. 0 = fail at the first API error.")
    stop_grace_seconds: float = Field(
        8.0, gt=0, exclude=True, description="How long a run told to stop (Ctrl-C, SIGTERM, Prefect's Cancel) may "
        "take to end its stage, close its engines and record its state before it ends at once (flows/stopping.py). "
        "Within Kubernetes' 30 s grace and Prefect's worker's.")
    auto_resumes: int = Field(
        3, ge=0, exclude=True, description="Deployment runs only (the `auto-resume` deployment's automations, "
        "deployments/prefect.yaml): how many times a Failed or Crashed rl-training/rl-nightly run, or one "
        "whose process stopped sending heartbeats, is started again with the same run_id. A failure "
        "caused by the input (config, data, run id) is never resumed. 0 = never.")
    auto_resume_delay_seconds: float = Field(
        60.0, ge=0, exclude=True, description="Deployment runs only: the wait before each automatic resume (the resumed "
        "run is created Scheduled that far ahead).")

    @field_validator("retry_delay_seconds")
    @classmethod
    def _delays_are_valid(cls, v: float | list[float]) -> float | list[float]:
        delays = v if isinstance(v, list) else [v]
        if not delays:
            raise ValueError("give at least one delay (or a single number)")
        if len(delays) > 50:
            raise ValueError(f"Prefect accepts at most 50 retry delays, got {len(delays)}")
        if any(d < 0 for d in delays):
            raise ValueError(f"retry delays must be >= 0, got {v}")
        return v


class PreferenceSection(PreferenceConfig):
    """Offline preference training (TRL's DPOTrainer / KTOTrainer): with this section in the
    config (`preference: {}` or any `preference.*` override) the run trains on a file of rated
    answers instead of rolling out: each iteration takes data.train_batch_size pairs (DPO) or
    examples (KTO), scores them with the reference model (model.path: the served CURRENT when
    retraining; with LoRA the actor with its adapter off) and takes the preference loss through
    the actor's optimizer (actor.lr, ppo_mini_batch_size pairs per step, ppo_micro_batch_size_per_gpu
    pairs per forward: a pair is never split). No rollout, reward or advantage stage runs; the
    validation is the implicit-reward metrics on held-out data (val/rewards/accuracies = val/acc).
    data.train_batch_size, data.seed and data.max_prompt_length apply; the prompt-dataset keys
    (data.train_files, data.val_files) do not: the data is named here."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    train_files: list[str] = Field(
        default_factory=list, description="Parquet files of preference data with TRL's columns: DPO pairs "
        "(prompt, chosen, rejected) or KTO rows (prompt, completion, label: true = desirable). prompt is chat "
        "messages or a string (one user turn); chosen/rejected/completion the assistant's text. Empty: "
        "preference.generate.")
    val_files: list[str] = Field(
        default_factory=list, description="Held-out preference files (same columns). Empty: the first "
        "preference.val_size rows of the training data are held out (and never trained on).")
    val_size: int = Field(64, ge=2, description="Held-out pairs/examples the validation scores.")
    generate: Literal["arith"] | None = Field(
        "arith", description="Built-in data generated into the run's storage when train_files is empty: "
        "'arith' = the built-in 2-digit addition prompts (data.seed), the correct sum chosen (desirable) and a "
        "wrong one rejected (undesirable); KTO gets each prompt once, alternately correct and wrong.")
    train_size: int = Field(2048, ge=2, description="Pairs (DPO) or examples (KTO) generated by preference.generate.")


class SFTMultiturnConfig(_Section):
    """Multi-turn demonstrations (verl's `data.multiturn`)."""

    enable: bool = Field(False, description="Rows hold whole conversations (OpenAI chat messages) in "
                         "messages_key instead of prompt_key/response_key columns; every assistant turn is trained "
                         "on, every other turn is context only (verl data.multiturn.enable).")
    messages_key: str = Field("messages", description="Column holding a row's chat messages with multiturn.enable "
                              "(verl data.multiturn.messages_key).")


class SFTSection(_Section):
    """Supervised fine-tuning (verl's SFT trainer, TRL's SFTTrainer): with this section in the
    config (`sft: {}` or any `sft.*` override) the run trains on demonstrations instead of rolling
    out, the peer of `preference:` (DPO/KTO). Each iteration takes data.train_batch_size rows (a
    pure function of (data.seed, epoch, k)), renders each as the rollout renders a conversation
    (the prompt through the chat template with the generation prompt, then each assistant turn's
    tokens and EOS) and takes the token-mean negative log-likelihood of the assistant's tokens
    through the actor's optimizer (actor.lr, ppo_mini_batch_size rows per step,
    ppo_micro_batch_size_per_gpu per forward). No rollout, reward or reference model runs; the
    validation scores held-out rows with the trainer: val/loss (token-mean NLL), val/token_acc and
    val/exact_match (the share of rows greedy decoding reproduces exactly) = val/acc."""

    train_files: list[str] = Field(
        default_factory=list, description="Parquet files of demonstrations, verl's SFT format: a prompt column "
        "(sft.prompt_key: text, one user turn, or chat messages) and a response column (sft.response_key: the "
        "assistant's text), or with sft.multiturn.enable a messages column. Empty: sft.generate.")
    val_files: list[str] = Field(
        default_factory=list, description="Held-out demonstration files (same columns). Empty: the first "
        "sft.val_size rows of the training data are held out (and never trained on).")
    val_size: int = Field(64, ge=1, description="Held-out rows each validation scores.")
    prompt_key: str = Field("prompt", description="Column of the prompt (verl data.prompt_key; verl's own "
                            "example files use 'question').")
    response_key: str = Field("response", description="Column of the response (verl data.response_key; verl's "
                              "own example files use 'answer').")
    multiturn: SFTMultiturnConfig = Field(default_factory=SFTMultiturnConfig,
                                          description="Conversations with several assistant turns (verl data.multiturn).")
    max_length: int = Field(1024, ge=2, description="Most tokens of a rendered demonstration (prompt and every "
                            "turn); a longer row is refused before the run starts, naming it (verl data.max_length "
                            "with truncation=error).")
    generate: Literal["arith"] | None = Field(
        "arith", description="Built-in demonstrations generated into the run's storage when train_files is empty: "
        "'arith' = the built-in 2-digit addition prompts (data.seed) answered with their sum.")
    train_size: int = Field(2048, ge=1, description="Demonstrations generated by sft.generate (held-out rows "
                            "included).")
