"""What the stage layer asks of the models it trains, written once as protocols.

    def apply(trainer: ActorTrainer, table) -> dict[str, float]:
        return trainer.update(table)              # any policy trainer below, the same call

- ``Trainer``: trained by the update stage and checkpointed: ``update``, ``save``/``load``
  (exact resume), ``save_hf``.
- ``LogProbModel``: scores response tokens (``compute_log_probs``): the reference model.
- ``ActorTrainer``: the policy: both of the above, plus the offline updates
  (``preference_update``: DPO/KTO, ``sft_update`` with ``compute_argmax_match`` for its held-out
  exact match; one rank only; a trainer that cannot run them raises NotImplementedError saying so), the weight stream to the rollout engine
  (``gathered_state_dict``/``iter_weight_buckets``), whether its update can be its own agreement
  probe (``probes_in_update``), and what a rank group adds (``groups_started``, ``state_lost``,
  ``close``; None/False/no-op in process, from ``InProcessTrainer``).
- ``CriticTrainer``: the value model: a Trainer with ``compute_values``.

Met by gpu_jobs.train.PolicyTrainer (full fine-tuning or LoRA), PipelinePolicyTrainer and
ranks.trainer.GroupTrainer (ActorTrainer), Critic (CriticTrainer), RefModel and AdapterOffRef
(LogProbModel); tests/train/test_trainer_protocol.py checks every member on every class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .weights import DEFAULT_BUCKET_BYTES, state_dict_buckets

if TYPE_CHECKING:
    from gpu_jobs.algos.preference import PreferenceConfig

__all__ = ["Trainer", "LogProbModel", "ActorTrainer", "CriticTrainer", "InProcessTrainer", "Probe"]

Probe = Callable[[Any, Any, Any], None]
"""``probe(rollout_logprobs, trainer_logprobs, response_mask)``, each ``(1, N)``: see
PolicyTrainer.update."""


@runtime_checkable
class Trainer(Protocol):
    """A model the update stage trains and a checkpoint saves."""

    step: int  # update() calls so far

    def update(self, batch: Any) -> dict[str, float]:
        """One update on ``batch`` (pyarrow.Table); verl-named metrics."""
        ...

    def save(self, url: str) -> str:
        """Commit the exact-resume state (weights, optimizer, step, RNG) at ``url``."""
        ...

    def load(self, url: str) -> None:
        """Restore a ``save(url)``."""
        ...

    def save_hf(self, url: str) -> str | None:
        """An HF checkpoint at ``url`` (``from_pretrained`` loads it)."""
        ...


@runtime_checkable
class LogProbModel(Protocol):
    """Scores the response tokens of a batch."""

    def compute_log_probs(self, batch: Any) -> list[Any]:
        """Per row, a float32 array of the log-prob of each response token (no grad)."""
        ...


@runtime_checkable
class ActorTrainer(Trainer, LogProbModel, Protocol):
    """The policy trainer the stages drive (``Roles.trainer``)."""

    probes_in_update: bool  # update(batch, probe=...) can score the agreement probe in its own forwards
    groups_started: int | None  # rank groups started so far; None in process (no group)
    state_lost: bool  # a rank group died holding updates: load a checkpoint or reset()

    def update(self, batch: Any, probe: Probe | None = None) -> dict[str, float]:
        """One policy update; ``probe`` needs ``probes_in_update``."""
        ...

    def preference_update(self, batch: Any, preference: PreferenceConfig) -> dict[str, float]:
        """One DPO/KTO update (``preference.algorithm``) on a committed preference batch
        (pyarrow.Table, one row per scored sequence: prompt_ids, response_ids, ref_logprobs, role,
        unit; gpu_jobs/train/preference.py), with the same optimizer, lr schedule and step count
        as ``update``. Returns TRL-named metrics (rewards/*, logps/*, kl for KTO) with
        actor/preference_loss, actor/grad_norm and actor/lr. One rank only: a trainer over
        several ranks or pipeline stages raises NotImplementedError before anything trains."""
        ...

    def sft_update(self, batch: Any) -> dict[str, float]:
        """One supervised (SFT) update on a committed SFT batch (prompt_ids, response_ids,
        response_mask: 1 on the assistant's tokens), the token-mean NLL with the same optimizer,
        lr schedule and step count as ``update``. Returns train/loss, actor/grad_norm, actor/lr."""
        ...

    def compute_argmax_match(self, batch: Any) -> list[Any]:
        """Per row, a float32 array: 1.0 where a response token is the model's argmax (no grad)."""
        ...

    def gathered_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights (HF names), in this process."""
        ...

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
                            ) -> Iterator[list[tuple[str, Any]]]:
        """The full weights as buckets of whole layers (weights.plan_buckets)."""
        ...

    def close(self) -> None:
        """Release processes the trainer runs (a rank group's); the trainer stays usable."""
        ...


@runtime_checkable
class CriticTrainer(Trainer, Protocol):
    """The value model (``Roles.critic``)."""

    def compute_values(self, batch: Any) -> list[Any]:
        """Per row, a float32 array of the value before each response token (no grad)."""
        ...


class InProcessTrainer:
    """The ActorTrainer members of a trainer whose ranks are this process (and its torchrun
    peers), not a rank group: no group to start, lose or close; weights cut from the gathered
    state dict (the host class's gathered_state_dict)."""

    probes_in_update: bool = False
    groups_started: int | None = None
    state_lost: bool = False

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
                            ) -> Iterator[list[tuple[str, Any]]]:
        """gathered_state_dict() in buckets of whole layers (``dtype``: a cast, else as gathered)."""
        yield from state_dict_buckets(self.gathered_state_dict(), bucket_bytes, dtype)

    def close(self) -> None:
        """Nothing to shut down: the engine goes with the object."""

    def preference_update(self, batch: Any, preference: PreferenceConfig) -> dict[str, float]:
        """No preference update on this trainer (PolicyTrainer has one): say so, by name."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot run preference (DPO/KTO) updates: they train on one rank with "
            "PolicyTrainer (no pipeline, one trainer rank: the run config's defaults)")

    def sft_update(self, batch: Any) -> dict[str, float]:
        """No SFT update on this trainer (PolicyTrainer has one): say so, by name."""
        raise NotImplementedError(f"{type(self).__name__} cannot run SFT updates: they train with PolicyTrainer "
                                  "(no pipeline, one trainer rank: the run config's defaults)")

    def compute_argmax_match(self, batch: Any) -> list[Any]:
        """No teacher-forced argmax on this trainer (PolicyTrainer has one): say so, by name."""
        raise NotImplementedError(f"{type(self).__name__} cannot score SFT's held-out exact match: use "
                                  "PolicyTrainer (no pipeline, one trainer rank)")
