"""The stage of a supervised fine-tuning iteration (the run config's `sft:` section), declared
once with `@stage`; the graph (graph.py) runs it in place of rollout .. advantages:

    sft_batch -> update (the same stage, with the SFT loss) -> commit

`sft_batch` takes iteration k's demonstrations (a pure function of (data.seed, epoch, k), as
prompts are for RL), lays each out in tokens as a rollout of it would be (sft_data.py) and
commits the table the update trains on. No reference model, no rollout engine. The validation
after update k is `held_out_sft`: the trainer's teacher-forced pass over the held-out rows,
with verl's SFT name val/loss (token-mean NLL of the assistant's tokens), val/token_acc (the
share of those tokens that are the model's argmax) and val/exact_match (the share of rows whose
every assistant token is: greedy decoding, given the same context, reproduces the
demonstration exactly, EOS included), which is the run's val/acc.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.run import Run
from gpu_jobs.stages.sft_data import sft_table
from gpu_jobs.stages.shell import Output, stage

__all__ = ["is_sft_run", "sft_batch", "held_out_sft", "sft_metrics"]


def is_sft_run(cfg: Any) -> bool:
    return cfg.sft is not None


def _table(run: Run, df: Any, rows: list[int], tag: str) -> pa.Table:
    return sft_table([df.iloc[i].to_dict() for i in rows], run.tokenizer, run.cfg, row_ids=rows, tag=tag)


@stage("sft_batch", timer="timing_s/sft_batch", needed=is_sft_run)
def sft_batch(run: Run, roles: Roles, k: int) -> Output:
    """Iteration k's demonstrations, tokenised, with the loss mask."""
    rows = run.sampler.indices(k - 1)  # iterations are 1-based, the sampler's steps 0-based
    table = _table(run, run.train, rows, tag=f"{k}-")
    masks = table.column("response_mask").to_pylist()
    return Output(table, {"data/epoch": run.sampler.epoch(k - 1), "sft/rows": float(len(rows)),
                          "sft/loss_tokens": float(sum(map(sum, masks))),
                          "response_length/mean": float(np.mean([len(m) for m in masks]))}, [])


def sft_metrics(log_probs: list[np.ndarray], matches: list[np.ndarray], masks: list[list[int]]) -> dict[str, float]:
    """val/loss, val/token_acc and val/exact_match from per-row response log-probs, argmax
    matches (1.0 where the token is the model's argmax) and loss masks, each (response_len,)."""
    import torch

    from gpu_jobs.algos.sft import greedy_exact, sft_loss

    width = max(len(m) for m in masks)

    def padded(rows: list[Any]) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.float64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.float64))
        return out

    lp, match, mask = padded(log_probs), padded(matches), padded(masks)
    loss, _ = sft_loss(lp, mask)
    return {"val/loss": float(loss), "val/token_acc": float((match * mask).sum() / mask.sum().clamp(min=1)),
            "val/exact_match": float(greedy_exact(match, mask).mean())}


def held_out_sft(run: Run, roles: Roles, k: int) -> tuple[pa.Table, dict[str, float]]:
    """The metrics of the weights after update k on the held-out rows (module doc), plus
    val/acc = val/exact_match. Returns (per-row table: uid, row, nll, exact, metrics)."""
    table = _table(run, run.val, list(range(len(run.val))), tag="val-")
    log_probs = roles.trainer.compute_log_probs(table)
    matches = roles.trainer.compute_argmax_match(table)
    masks = table.column("response_mask").to_pylist()
    metrics = sft_metrics(log_probs, matches, masks)
    metrics["val/acc"] = metrics["val/exact_match"]
    metrics["val/weights_of_iteration"] = roles.version
    per_row = [sft_metrics([lp], [mt], [m]) for lp, mt, m in zip(log_probs, matches, masks)]
    rows = table.select(["uid", "row"]).append_column("nll", pa.array([r["val/loss"] for r in per_row], pa.float64()))
    return rows.append_column("exact", pa.array([r["val/exact_match"] for r in per_row], pa.float64())), metrics
