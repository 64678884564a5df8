"""Policy, reference and value models on DeepSpeed (ZeRO-3 over ranks), and the update job.

    from gpu_jobs.train import PolicyTrainer, ActorConfig
    trainer = PolicyTrainer(model_dir, ActorConfig(lr=1e-5))
    metrics = trainer.update(batch_table)

Job: ``python -m gpu_jobs.train --batch URL --checkpoint URL --out URL --config FILE.yaml``
(also under ``torchrun --nproc_per_node N``). ``import gpu_jobs.train`` stays light: the
classes that need torch/deepspeed load on first use.
"""

from __future__ import annotations

from typing import Any

from .errors import TrainInputError

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "PolicyTrainer",
    "RefModel",
    "Critic",
    "PipelinePolicyTrainer",
    "TrainInputError",
    "PIPELINE_ZERO_ERROR",
]

_LAZY = {
    "ActorConfig": "config",
    "CriticConfig": "config",
    "PIPELINE_ZERO_ERROR": "config",
    "PolicyTrainer": "policy",
    "RefModel": "policy",
    "Critic": "critic",
    "PipelinePolicyTrainer": "pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
