"""The warm engines of a run: trainer, reference model, critic and rollout engine, kept loaded
across iterations, and the weights version they hold.

    engines = Engines.load(run)                  # builds the DeepSpeed trainer and the rollout engine
    engines = Engines.load(run, trainer=False)   # a rollout-only process (remote placement)

Loading a model for every stage is the cost that sinks orchestrated RL, so the flow builds these
once and passes them to every stage; a stage in another process builds its own from storage.
Everything here is derived from committed data: `resume.restore` brings a fresh set to the
state after the last committed update.
"""

from __future__ import annotations

from typing import Any

from gpu_jobs.stages.run import Run


class Engines:
    """Warm engines for (model, weights version): `version` is the iteration whose update the
    weights include (0 = the start model). A plain class so Prefect passes it through as is."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.trainer: Any = None
        self.ref: Any = None
        self.critic: Any = None
        self.rollout: Any = None
        self.version = 0
        # Metrics of updates applied in this process, kept until their stage commits: a retry
        # after a failed commit must not train twice (see iteration.update).
        self.update_metrics: dict[int, dict] = {}

    def __repr__(self) -> str:
        return f"Engines({self.model_path!r} at weights version {self.version})"

    @classmethod
    def load(cls, run: Run, *, trainer: bool = True, rollout: bool = True) -> "Engines":
        engines = cls(run.model_path)
        if rollout:
            engines.load_rollout(run)
        if trainer:
            engines.load_trainers(run)
        return engines

    def load_rollout(self, run: Run) -> None:
        from gpu_jobs.rollout import get_rollout_engine

        cfg = run.cfg
        self.rollout = get_rollout_engine(cfg.rollout.engine, self.model_path, cfg.rollout.engine_options,
                                          storage=cfg.storage)

    def load_trainers(self, run: Run) -> None:
        """The policy trainer, and the reference model and critic when the algorithm needs them,
        all at the start model's weights."""
        from gpu_jobs.train import Critic, PolicyTrainer, RefModel

        cfg, tok = run.cfg, run.tokenizer
        # The logprobs stage commits old_logprobs when asked to; the trainer must not redo it.
        actor = cfg.actor.model_copy(update={"recompute_old_logprobs": False})
        self.trainer = PolicyTrainer(self.model_path, actor, tokenizer=tok, storage=cfg.storage)
        self.ref = RefModel(self.model_path, cfg.actor, tokenizer=tok, storage=cfg.storage) if cfg.needs_ref else None
        self.critic = (Critic(self.model_path, cfg.critic, tokenizer=tok, storage=cfg.storage)
                       if cfg.critic is not None else None)
        self.version = 0

    def sync_rollout(self) -> None:
        """Hand the trainer's full weights to the rollout engine, in memory."""
        self.rollout.update_weights(self.trainer.gathered_state_dict())

    def close(self) -> None:
        self.trainer = self.ref = self.critic = self.rollout = None
