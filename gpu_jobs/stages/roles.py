"""The warm roles of a run (verl's word): trainer, reference model, critic and rollout engine, kept loaded
across iterations, and the weights version they hold.

    roles = Roles.load(run)                  # builds the DeepSpeed trainer and the rollout engine
    roles = Roles.load(run, trainer=False)   # a rollout-only process (remote placement)

Loading a model for every stage is the cost that sinks orchestrated RL, so the flow builds these
once and passes them to every stage; a stage in another process builds its own from storage.
Everything here is derived from committed data: `resume.restore` brings a fresh set to the
state after the last committed update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpu_jobs.stages.run import Run

if TYPE_CHECKING:
    from gpu_jobs.rollout.base import RolloutEngine
    from gpu_jobs.train.protocol import ActorTrainer, CriticTrainer, LogProbModel


class Roles:
    """The warm roles for (model, weights version): `version` is the iteration whose update the
    weights include (0 = the start model). A plain class so Prefect passes it through as is."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.trainer: ActorTrainer | None = None
        self.ref: LogProbModel | None = None
        self.critic: CriticTrainer | None = None
        self.rollout: RolloutEngine | None = None
        self.reward_model: Any = None  # the reward-model stage's scorer, loaded on first use (load_reward_model)
        self.version = 0
        self.rollout_version = 0  # the update whose weights the rollout engine holds
        # Metrics of updates applied in this process, kept until their stage commits: a retry
        # after a failed commit must not train twice (see iteration.update).
        self.update_metrics: dict[int, dict] = {}

    def __repr__(self) -> str:
        return f"Roles({self.model_path!r}: trainer at update {self.version}, rollout at {self.rollout_version})"

    @classmethod
    def load(cls, run: Run, *, trainer: bool = True, rollout: bool = True) -> "Roles":
        roles = cls(run.model_path)
        if rollout:
            roles.load_rollout(run)
        if trainer:
            roles.load_trainers(run)
        return roles

    def load_rollout(self, run: Run) -> None:
        from gpu_jobs.rollout.data_parallel import build_rollout_engine

        from gpu_jobs.rollout.agent_loop import with_agent_loop

        cfg = run.cfg
        engine = build_rollout_engine(cfg.rollout.engine, self.model_path, cfg.rollout.engine_options,
                                    storage=cfg.storage)
        # Multi-turn runs: every user of the engine (rollout, validation, the start probe) goes
        # through the tool loop; unchanged when rollout.multi_turn.enable is false.
        self.rollout = with_agent_loop(engine, cfg.rollout.multi_turn, run.tokenizer, cfg.data.prompt_key)
        self.rollout_version = 0

    def load_trainers(self, run: Run) -> None:
        """The policy trainer, and the reference model and critic when the algorithm needs them,
        all at the start model's weights."""
        from gpu_jobs.train import Critic, PolicyTrainer, RefModel

        cfg, tok = run.cfg, run.tokenizer
        # The logprobs stage commits old_logprobs when asked to, and the trainer must not redo it;
        # a single-step update takes them from its own forward instead (no logprobs stage).
        actor = cfg.actor.model_copy(update={"recompute_old_logprobs": cfg.old_logprobs_from_update})
        ranks = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        if self.trainer is not None:
            self.trainer.close()
        lora_policy = None  # a LoRA PolicyTrainer: its reference is itself with the adapter off
        if ranks > 1:
            # A warm group of DeepSpeed ranks (torchrun), started on first use and kept for the
            # run: every update/log-prob pass is a command to it, not a new launch.
            from gpu_jobs.train.ranks.trainer import GroupTrainer

            self.trainer = GroupTrainer(self.model_path, actor, n_ranks=ranks, tokenizer=tok, storage=cfg.storage,
                                        model_source=cfg.model.path, **self._rendezvous(cfg.trainer))
        else:
            from gpu_jobs.models.lora import lora_spec_of

            lora = lora_spec_of(cfg.model)  # None: full fine-tuning (one rank only with LoRA: config checks)
            self.trainer = PolicyTrainer(self.model_path, actor, tokenizer=tok, storage=cfg.storage, lora=lora)
            lora_policy = self.trainer if lora is not None else None
        if not cfg.needs_ref:
            self.ref = None
        elif lora_policy is not None:
            self.ref = lora_policy.reference()  # the actor with its adapter off: the base, no copy
        else:
            self.ref = RefModel(self.model_path, cfg.actor, tokenizer=tok, storage=cfg.storage)
        self.critic = (Critic(self.model_path, cfg.critic, tokenizer=tok, storage=cfg.storage)
                       if cfg.critic is not None else None)
        self.version = 0

    def _rendezvous(self, trainer: Any) -> dict[str, Any]:
        if not hasattr(self, "_nodes"):  # once: the environment's values are taken out of it
            self._nodes = _rendezvous(trainer)
        return self._nodes

    def sync_rollout(self) -> None:
        """Hand the trainer's full weights to the rollout engine, in memory (from a rank group:
        gathered on the ranks one tensor at a time and shipped in buckets)."""
        from gpu_jobs.train.weights import stream_weights_into_rollout

        stream_weights_into_rollout(self.rollout, self.trainer)
        self.rollout_version = self.version

    def put_rollout_at(self, run: Run, version: int) -> None:
        """Make the rollout engine hold the weights after update `version`: in memory from the
        trainer when it holds exactly those, else from storage (the policy folder the update
        published, or the start model). Callers make sure no update runs meanwhile."""
        if self.rollout_version == version:
            return
        if self.trainer is not None and self.version == version:
            self.sync_rollout()
            return
        source = self.model_path if version == 0 else run.layout.policy(version)
        try:
            self.rollout.update_weights(source)
        except FileNotFoundError as e:
            raise RuntimeError(f"the rollout needs the weights after update {version}, but {source} holds none "
                               f"({e}); they are published by the update of iteration {version}") from e
        self.rollout_version = version

    def load_reward_model(self, run: Run) -> Any:
        """The reward model's scorer (reward_model.*), loaded on first use and kept for the run:
        the reward-model stage's own warm engine. Its weights never change during a run."""
        if self.reward_model is None:
            self.reward_model = load_reward_scorer(run)
        return self.reward_model

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()  # a rank group's processes go with it
        if self.rollout is not None and hasattr(self.rollout, "close"):
            self.rollout.close()  # data-parallel replicas' processes, a vLLM engine's KV cache
        self.trainer = self.ref = self.critic = self.rollout = self.reward_model = None


def load_reward_scorer(run: Run) -> Any:
    """A ModelRewardScorer for the run's reward_model section ('builtin' = the project's tiny
    arithmetic reward model, built and cached on first use)."""
    from gpu_jobs.models.reward_model import resolve_reward_model_path
    from gpu_jobs.reward import ModelRewardScorer

    rm = run.cfg.reward_model
    path = resolve_reward_model_path(rm.model.path, run.storage)
    return ModelRewardScorer(path, max_length=rm.max_length or 1 << 30, batch_size=rm.micro_batch_size_per_gpu)


def _rendezvous(trainer: Any) -> dict[str, Any]:
    """nnodes, master_addr and master_port of the rank group: the config's, else (nnodes > 1) this
    process's MASTER_ADDR / MASTER_PORT, which are then taken out of its environment: they name the
    group's rendezvous, and a one-rank DeepSpeed engine built here (reference model, critic) must
    pick a port of its own instead of taking the one node 0's launcher listens on."""
    import os

    if trainer.nnodes == 1:
        return {"nnodes": 1}
    addr = trainer.master_addr or os.environ.pop("MASTER_ADDR", "")
    port = trainer.master_port or int(os.environ.pop("MASTER_PORT", "0") or 0)
    return {"nnodes": trainer.nnodes, "master_addr": addr, "master_port": port}
