"""Scoring sampled responses: the rows a reward function sees, and the one greedy evaluator
(validation, ReMax baselines, the nightly flow's held-out comparison).

    table, metrics = greedy_evaluate(engine, tokenizer, prompts, ids, reward_cfg, max_response_length)
    metrics["val/acc"]     # mean score of one greedy response per prompt
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from gpu_jobs.stages.samples import sample_table

__all__ = ["reward_rows", "greedy_evaluate"]


def reward_rows(tokenizer: Any, table: pa.Table) -> list[dict]:
    """verl's compute_score arguments for each row of a sample table (responses decoded)."""
    texts = tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
    return [{"data_source": d, "solution_str": s, "ground_truth": g, "extra_info": e}
            for d, s, g, e in zip(table.column("data_source").to_pylist(), texts,
                                  table.column("ground_truth").to_pylist(), table.column("extra_info").to_pylist())]


def greedy_evaluate(engine: Any, tokenizer: Any, prompts: Sequence[dict], ids: Sequence[Sequence[int]],
                    reward_cfg: Any, max_response_length: int, *, iteration: int = 0,
                    tag: str = "") -> tuple[pa.Table, dict[str, float]]:
    """One greedy response per prompt, scored with the run's reward.

    `prompts` are verl rows (with `row`, their dataset index), `ids` their token ids. Returns the
    sample table with `score` and `response_text` columns, and `val/acc` (mean score), `val/n`.
    Greedy decoding of fixed weights is deterministic, so a retry gives the same table.
    """
    from gpu_jobs.reward import score_batch
    from gpu_jobs.rollout import SamplingConfig

    out = engine.generate([list(x) for x in ids], 1,
                          SamplingConfig(temperature=0.0, max_response_length=max_response_length, seed=0))
    table = sample_table(out, prompts, iteration, tag=tag)
    rows = reward_rows(tokenizer, table)
    scores, _, _ = score_batch(rows, reward_cfg)
    table = table.append_column("score", pa.array(scores, pa.float32())).append_column(
        "response_text", pa.array([r["solution_str"] for r in rows]))
    return table, {"val/acc": float(np.mean(scores)) if len(scores) else 0.0, "val/n": len(scores)}
