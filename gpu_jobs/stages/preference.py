"""The stages of an offline preference iteration (the run config's `preference:` section), each
declared once with `@stage`; the graph (graph.py) runs them in place of rollout .. advantages:

    preference_batch -> preference_ref -> update (the same stage, with the preference loss) -> commit

`preference_batch` takes iteration k's pairs/examples (a pure function of (data.seed, epoch, k),
as prompts are for RL), tokenises them with the chat template and commits them in whole units
(preference_data.py); `preference_ref` adds the reference model's per-token log-probs (the start
weights, model.path: the served CURRENT when retraining; with LoRA the actor with its adapter
off) and commits the table the update trains on. The validation after update k is
`held_out_preferences`: TRL's implicit-reward metrics on the held-out rows (val/rewards/...),
with val/rewards/accuracies as the run's val/acc.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from gpu_jobs.stages.preference_data import preference_table
from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.run import Run
from gpu_jobs.stages.samples import FLOAT_LIST
from gpu_jobs.stages.shell import Output, read, stage

__all__ = ["is_preference_run", "preference_batch", "preference_ref", "held_out_preferences"]


def is_preference_run(cfg: Any) -> bool:
    return cfg.preference is not None


def _table(run: Run, df: Any, rows: list[int], tag: str) -> pa.Table:
    cfg = run.cfg
    return preference_table([df.iloc[i].to_dict() for i in rows], run.tokenizer, cfg.preference.algorithm,
                            micro_size=cfg.actor.ppo_micro_batch_size_per_gpu,
                            max_prompt_length=cfg.data.max_prompt_length, row_ids=rows, tag=tag)


@stage("preference_batch", timer="timing_s/preference_batch", needed=is_preference_run)
def preference_batch(run: Run, roles: Roles, k: int) -> Output:
    """Iteration k's pairs (DPO) or examples (KTO), tokenised, in whole units."""
    rows = run.sampler.indices(k - 1)  # iterations are 1-based, the sampler's steps 0-based
    table = _table(run, run.train, rows, tag=f"{k}-")
    lens = np.asarray([len(r) for r in table.column("response_ids").to_pylist()], dtype=np.float64)
    return Output(table, {"data/epoch": run.sampler.epoch(k - 1), "preference/rows": float(len(rows)),
                          "response_length/mean": float(lens.mean())}, [])


@stage("preference_ref", needed=is_preference_run, where="trainer")
def preference_ref(run: Run, roles: Roles, k: int, batch_uri: str) -> Output:
    """The batch with the reference model's per-token log-probs (`ref_logprobs`): what the update reads."""
    table = read(run, batch_uri)
    t0 = time.perf_counter()
    ref = roles.ref.compute_log_probs(table)
    out = table.append_column("ref_logprobs", pa.array([x.tolist() for x in ref], FLOAT_LIST))
    return Output(out, {"timing_s/ref": time.perf_counter() - t0}, [batch_uri])


def held_out_preferences(run: Run, roles: Roles, k: int) -> tuple[pa.Table, dict[str, float]]:
    """The implicit-reward metrics of the weights after update k on the held-out rows, as TRL's
    evaluation names them under val/ (val/rewards/accuracies, val/rewards/margins, ...), plus
    val/acc = val/rewards/accuracies. Returns (per-row table, metrics)."""
    import torch

    from gpu_jobs.train.preference import PREFERENCE_OBJECTIVES, NanWeightedMeans, units_of

    cfg = run.cfg
    table = _table(run, run.val, list(range(len(run.val))), tag="val-")
    policy, ref = roles.trainer.compute_log_probs(table), roles.ref.compute_log_probs(table)
    seq = torch.tensor([float(x.sum()) for x in policy], dtype=torch.float64)
    ref_seq = torch.tensor([float(x.sum()) for x in ref], dtype=torch.float64)
    length = torch.tensor([float(len(x)) for x in policy], dtype=torch.float64)
    roles_ = np.asarray(table.column("role").to_pylist(), dtype=object)
    objective = PREFERENCE_OBJECTIVES[cfg.preference.algorithm]
    means = NanWeightedMeans()
    # Unit by unit, as the update sees them: a KTO unit's reference point is its own KL rows.
    for unit in units_of(table.column("unit").to_pylist()):
        idx = torch.tensor(unit)
        _, metrics = objective.loss(seq[idx], ref_seq[idx], length[idx], roles_[unit], cfg.preference.loss_kwargs())
        means.add(metrics, float(np.isin(roles_[unit], objective.counted).sum()))
    metrics = {f"val/{name}": v for name, v in means.mean().items()}
    metrics["val/acc"] = metrics["val/rewards/accuracies"]
    metrics["val/weights_of_iteration"] = roles.version
    rows = table.select(["uid", "unit", "role", "row"]).append_column(
        "logratio", pa.array((seq - ref_seq).tolist(), pa.float64()))
    return rows, metrics
