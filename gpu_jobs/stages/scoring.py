"""Scoring sampled responses: the rows a reward function sees, the one evaluator (validation,
ReMax baselines; the nightly flow and the retrain read its committed validation stage) and the
scored samples an iteration's artifact shows.

    table, metrics = evaluate(engine, tokenizer, prompts, ids, reward_cfg, max_response_length,
                              cfg.rollout.val_kwargs, seed=1)
    metrics["val/acc"]                               # mean score of every response
    metrics["val-core/rlmill/arith/reward/mean@4"]   # verl's metrics (gpu_jobs.reward.val_metrics)
    table, metrics = greedy_evaluate(engine, tokenizer, prompts, ids, reward_cfg, max_response_length)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from gpu_jobs.stages.sections import ValKwargs
from gpu_jobs.stages.samples import sample_table

__all__ = ["reward_rows", "evaluate", "greedy_evaluate", "validation_infos", "artifact_samples"]


def reward_rows(tokenizer: Any, table: pa.Table) -> list[dict]:
    """verl's compute_score arguments for each row of a sample table (responses decoded)."""
    texts = tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
    return [{"data_source": d, "solution_str": s, "ground_truth": g, "extra_info": e}
            for d, s, g, e in zip(table.column("data_source").to_pylist(), texts,
                                  table.column("ground_truth").to_pylist(), table.column("extra_info").to_pylist())]


def validation_infos(rows: Sequence[dict], scores: Sequence[float], extras: Sequence[dict]) -> dict[str, list]:
    """The per-response variables verl's validation metrics are computed over: `reward` (the
    score), every numeric reward extra that all rows report (e.g. `acc`), and `pred`: the
    function's own "pred" extra when every row has one, else the data source's extracted answer."""
    from gpu_jobs.reward.predictions import extract_prediction

    infos: dict[str, list] = {"reward": [float(s) for s in scores]}
    shared = set.intersection(*(set(e) for e in extras)) if extras else set()
    for key in sorted(shared - {"pred", "reward", "error", "error_kind"}):
        vals = [e[key] for e in extras]
        if all(isinstance(v, (int, float)) for v in vals):
            infos[key] = [float(v) for v in vals]
    if "pred" in shared:
        infos["pred"] = [str(e["pred"]) for e in extras]
    else:
        infos["pred"] = [extract_prediction(r["data_source"], r["solution_str"]) for r in rows]
    return infos


def evaluate(engine: Any, tokenizer: Any, prompts: Sequence[dict], ids: Sequence[Sequence[int]],
             reward_cfg: Any, max_response_length: int, val_kwargs: ValKwargs, *, seed: int,
             iteration: int = 0, tag: str = "") -> tuple[pa.Table, dict[str, float]]:
    """val_kwargs.n responses per prompt (greedy unless val_kwargs.do_sample), scored with the
    run's reward.

    `prompts` are verl rows (with `row`, their dataset index), `ids` their token ids. Returns the
    sample table with `score`, `response_text` and `pred` columns, and the metrics `val/acc` (mean
    score over all responses; with one greedy response per prompt, the share answered right
    under a 0/1 reward), `val/n` (responses) and verl's `val-core/...` / `val-aux/...` per data
    source. Sampling is seeded and greedy decoding deterministic, so a retry gives the same table.
    """
    from gpu_jobs.reward import score_batch
    from gpu_jobs.reward.val_metrics import validation_metrics
    from gpu_jobs.rollout.agent_loop import generate_with_rows

    out = generate_with_rows(engine, list(prompts), ids, val_kwargs.n, val_kwargs.sampling(max_response_length, seed))
    table = sample_table(out, prompts, iteration, tag=tag)
    rows = reward_rows(tokenizer, table)
    scores, extras, _ = score_batch(rows, reward_cfg)
    infos = validation_infos(rows, scores, extras)
    table = (table.append_column("score", pa.array(scores, pa.float32()))
             .append_column("response_text", pa.array([r["solution_str"] for r in rows]))
             .append_column("pred", pa.array(infos["pred"], pa.string())))
    metrics: dict[str, float] = {"val/acc": float(np.mean(scores)) if len(scores) else 0.0, "val/n": len(scores)}
    if len(scores):
        metrics.update(validation_metrics(table.column("data_source").to_pylist(),
                                          table.column("group_id").to_pylist(), infos))
    return table, metrics


def greedy_evaluate(engine: Any, tokenizer: Any, prompts: Sequence[dict], ids: Sequence[Sequence[int]],
                    reward_cfg: Any, max_response_length: int, *, iteration: int = 0,
                    tag: str = "") -> tuple[pa.Table, dict[str, float]]:
    """One greedy response per prompt, scored with the run's reward (`evaluate` with the
    default val_kwargs): `val/acc` is the mean score, `val/n` the number of prompts."""
    return evaluate(engine, tokenizer, prompts, ids, reward_cfg, max_response_length, ValKwargs(), seed=0,
                    iteration=iteration, tag=tag)


def artifact_samples(run: Any, batch_uri: str | None, reward_uri: str | None, n: int) -> list[dict]:
    """The first response to each of the first `n` prompts of a committed batch, decoded, with
    its ground truth and score (what an iteration's markdown artifact shows)."""
    from gpu_jobs.reward import decode_ground_truth
    from storage import read_table

    if n <= 0 or batch_uri is None or reward_uri is None:  # a preference run samples and scores nothing
        return []
    batch = read_table(batch_uri, columns=["uid", "sample_index", "prompt_ids", "ground_truth"],
                       storage=run.storage).to_pylist()
    rewards = {r["uid"]: r for r in read_table(reward_uri, columns=["uid", "response_text", "score"],
                                               storage=run.storage).to_pylist()}
    firsts = [row for row in batch if row["sample_index"] == 0][:n]
    return [{"prompt": run.tokenizer.decode(row["prompt_ids"], skip_special_tokens=True),
             "response": rewards[row["uid"]]["response_text"], "truth": decode_ground_truth(row["ground_truth"]),
             "score": rewards[row["uid"]]["score"]} for row in firsts]
