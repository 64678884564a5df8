"""DAPO dynamic sampling with batch refill (Yu et al., arXiv:2503.14476; verl recipe/dapo).

Generate, score and filter rounds of prompts until ``data.train_batch_size`` groups have a
non-constant ``filter_groups.metric``, then keep exactly that many (the first ones). The rollout
stage passes two callables, so nothing here touches an engine or a reward pool:

    base_seed = sampling_seed(cfg.data.seed, k)

    def generate_round(r):
        plan = round_plan(ctx.sampler, k, r, base_seed)
        prompts, ids = _prompts(ctx, ctx.train, plan.rows, cfg.data.max_prompt_length)
        out = ctx.engine.generate(ids, cfg.rollout.n, cfg.rollout.sampling(plan.seed))
        return sample_table(out, prompts, k, tag=plan.tag)

    def score_round(table):
        scores, extras, _ = score_batch(_reward_rows(ctx, table), cfg.reward)
        return scores, extras

    table, metrics = refill_rounds(generate_round, score_round, **refill_settings(cfg))

Iteration k stays a pure function of (seed, epoch, k). Round 0 is exactly the sampler's batch for
k with the iteration's sampling seed, so an iteration whose first round suffices sees what it saw
without refill. Round r >= 1 takes the r-th chunk of a permutation, seeded by (seed, k), of the
rows round 0 did not use, sampled with a seed derived from (iteration seed, r). A retried rollout
regenerates the same rounds and keeps the same groups. Unlike verl, whose refill advances the
dataloader (so step k+1's prompts depend on how many rounds step k needed), extra rounds do not
consume the epoch: their prompts may also appear in other iterations of the same epoch.

Stopping: after ``max_rounds`` rounds (``filter_groups.max_num_gen_batches``; 0 = no cap) with too
few groups it raises, as verl does. With no cap the rounds still end: an iteration never repeats
a prompt, so once every row of the dataset has been generated it raises instead of looping.
Run the tests with ``.venv/bin/python -m pytest -q tests/flows/test_dynamic_sampling.py``.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import torch

from gpu_jobs.stages.samples import SAMPLE_SCHEMA

__all__ = [
    "DynamicSamplingError",
    "PromptsExhaustedError",
    "RoundPlan",
    "refill_rounds",
    "refill_settings",
    "round_plan",
    "round_rows",
    "round_seed",
    "round_tag",
]

# Third entropy word of the extra rounds' permutation: epoch_permutation seeds with [seed, epoch],
# so [seed, k, 1] can never replay an epoch's order.
_REFILL_STREAM = 1

GenerateRound = Callable[[int], pa.Table]
ScoreRound = Callable[[pa.Table], tuple[Sequence[float], Sequence[Mapping[str, Any]]]]


class DynamicSamplingError(RuntimeError):
    """The rounds allowed for one iteration did not leave enough groups to train on."""


class PromptsExhaustedError(DynamicSamplingError):
    """Round r would need prompts beyond the dataset: every row was already generated this iteration."""


class RoundPlan(NamedTuple):
    """What round r of iteration k generates: dataset ``rows``, the engine's sampling ``seed``,
    and the group-id ``tag`` for ``sample_table`` (keeps group ids unique across rounds)."""

    rows: list[int]
    seed: int
    tag: str


def round_rows(sampler: Any, k: int, r: int) -> list[int]:
    """Dataset rows of round ``r`` (0-based) of iteration ``k`` (1-based, as the stages count).

    Round 0 is ``sampler.indices(k - 1)``. Round r >= 1 is chunk r-1 (``sampler.batch_size`` rows;
    the last one may be shorter) of a (seed, k)-seeded permutation of the rows round 0 left out,
    so no prompt repeats within an iteration. Raises PromptsExhaustedError past the last chunk.
    Costs one permutation of the dataset per call (1M rows: ~10 ms).
    """
    if k < 1 or r < 0:
        raise ValueError(f"round_rows needs iteration k >= 1 and round r >= 0, got {k=} {r=}")
    first = sampler.indices(k - 1)
    if r == 0:
        return first
    used = set(first)
    order = np.random.default_rng([sampler.seed, k, _REFILL_STREAM]).permutation(sampler.n_rows)
    rest = [int(i) for i in order if int(i) not in used]
    chunk = rest[(r - 1) * sampler.batch_size: r * sampler.batch_size]
    if not chunk:
        raise PromptsExhaustedError(
            f"round {r} of iteration {k} has no prompts left: the dataset's {sampler.n_rows} rows were all "
            f"generated in rounds 0..{r - 1}"
        )
    return chunk


def round_seed(base_seed: int, r: int) -> int:
    """Sampling seed of round ``r``: ``base_seed`` (the iteration's, ``sampling_seed(seed, k)``)
    for round 0, so that round is unchanged by refill; a distinct derived seed after it."""
    if r == 0:
        return base_seed
    return int(np.random.SeedSequence([base_seed, r]).generate_state(1)[0]) % (2**31 - 1)


def round_tag(r: int) -> str:
    """Group-id prefix of round ``r``: '' for round 0 (ids as without refill), 'r<r>-' after."""
    return "" if r == 0 else f"r{r}-"


def round_plan(sampler: Any, k: int, r: int, base_seed: int) -> RoundPlan:
    """Rows, sampling seed and group tag of round ``r`` of iteration ``k``; see ``round_rows``."""
    return RoundPlan(round_rows(sampler, k, r), round_seed(base_seed, r), round_tag(r))


def refill_settings(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of ``refill_rounds`` from a run config: ``metric``, ``want_groups``
    (data.train_batch_size), ``max_rounds`` (max_num_gen_batches) and ``overlong`` (the penalty
    the advantages stage adds, needed by 'seq_reward'/'seq_final_reward')."""
    from gpu_jobs.algos import overlong_penalty

    fg, ob = cfg.algorithm.filter_groups, cfg.overlong_buffer
    if not fg.enable:
        raise ValueError("refill_settings: algorithm.filter_groups.enable is False; generate one round instead")
    overlong = None
    if ob.enable:
        overlong = functools.partial(overlong_penalty, max_response_length=cfg.rollout.max_response_length,
                                     overlong_buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    return {"metric": fg.metric, "want_groups": cfg.data.train_batch_size,
            "max_rounds": fg.max_num_gen_batches, "overlong": overlong}


def _survivors(table: pa.Table, scores: Sequence[float], extras: Sequence[Mapping[str, Any]], metric: str,
               overlong: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[pa.Table, int, int]:
    """One round's rows of non-flat groups, the round's group count and how many were flat."""
    from gpu_jobs.algos import filter_groups, filter_metric

    if len(scores) != len(table) or len(extras) != len(table):
        raise ValueError(f"score_round returned {len(scores)} scores and {len(extras)} extras for {len(table)} rows")
    if len(table) == 0:
        return table, 0, 0
    lengths = torch.as_tensor(np.asarray(table.column("response_len").to_pylist(), dtype=np.int64))
    values = filter_metric(metric, scores, extras, overlong(lengths) if overlong is not None else None)
    keep, m = filter_groups(table.column("group_id").to_pylist(), values)
    return table.filter(pa.array(keep.numpy())), int(m["filter_groups/num_groups"]), \
        int(m["filter_groups/dropped_groups"])


def _first_groups(table: pa.Table, n: int) -> pa.Table:
    """The rows of the first ``n`` groups, in order of first appearance (verl's ``batch[:traj_bsz]``,
    which assumes n responses per group; counting groups also holds after the gate drops rows)."""
    keep = set(list(dict.fromkeys(table.column("group_id").to_pylist()))[:n])
    return table.filter(pa.array([g in keep for g in table.column("group_id").to_pylist()]))


def _new_round(generate_round: GenerateRound, r: int, seen: set[str], short: str) -> pa.Table:
    """Round r's table, checked (SAMPLE_SCHEMA, group ids new); its group ids join `seen`.
    `short`: what the rounds so far left short, for the error when the dataset runs out."""
    try:
        table = generate_round(r)
    except PromptsExhaustedError as e:
        raise DynamicSamplingError(
            f"dynamic sampling: {short}, and every prompt of the dataset has been generated in this iteration "
            f"({e}). Check the data and the reward, use a larger dataset or lower data.train_batch_size") from e
    if not table.schema.equals(SAMPLE_SCHEMA, check_metadata=False):
        raise TypeError(f"generate_round({r}) must return a SAMPLE_SCHEMA table (sample_table), got {table.schema}")
    groups = set(table.column("group_id").to_pylist())
    if groups & seen:
        raise ValueError(f"round {r} repeats group ids of an earlier round, e.g. {sorted(groups & seen)[:3]}: "
                         "build its table with sample_table(..., tag=round_tag(r))")
    seen |= groups
    return table


def refill_rounds(generate_round: GenerateRound, score_round: ScoreRound, *, metric: str, want_groups: int,
                  max_rounds: int = 0, overlong: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  ) -> tuple[pa.Table, dict[str, float]]:
    """Rounds r = 0, 1, ... of generate -> score -> drop flat groups, until ``want_groups`` survive.

    ``generate_round(r)``: a SAMPLE_SCHEMA table of round r (group ids unique across rounds, e.g.
    ``sample_table(..., tag=round_tag(r))``), deterministic in r. ``score_round(table)``: one score
    and one reward-extra dict per row (``score_batch``'s first two results). ``metric``: see
    ``gpu_jobs.algos.filter_metric``; ``overlong``: ``(bs,)`` response lengths -> ``(bs,)``
    penalties, or None. ``max_rounds`` = 0 means no cap (bounded by the dataset, see the module).

    Returns the surviving rows of exactly ``want_groups`` groups (round order, then row order;
    SAMPLE_SCHEMA) and metrics: ``filter_groups/num_gen_batches`` (rounds run), ``gen_groups``,
    ``gen_dropped_groups``, ``gen_dropped_frac`` (over all rounds), ``kept_groups``,
    ``surplus_groups`` (survivors trimmed away), ``gen_response_tokens`` (the response tokens of every
    round, dropped groups included: what generation cost), ``timing_s/gen`` and ``timing_s/filter_reward``.
    The ``gen_`` prefix keeps them apart from the advantages stage's ``filter_groups/*``.
    Raises DynamicSamplingError past ``max_rounds`` or when the dataset runs out.
    """
    if want_groups < 1 or max_rounds < 0:
        raise ValueError(f"refill_rounds needs want_groups >= 1 and max_rounds >= 0, got {want_groups=} {max_rounds=}")
    kept: list[pa.Table] = []
    seen: set[str] = set()
    n_kept = n_gen = n_flat = n_tokens = r = 0
    gen_s = score_s = 0.0
    while n_kept < want_groups:
        short = (f"{r} generation round(s) left {n_kept} of the {want_groups} groups that data.train_batch_size asks "
                 f"for with a non-constant filter_groups.metric={metric!r} ({n_flat} of {n_gen} groups were flat)")
        if max_rounds and r >= max_rounds:
            raise DynamicSamplingError(
                f"dynamic sampling: {short}, and algorithm.filter_groups.max_num_gen_batches={max_rounds}. The "
                "prompts may be too easy or too hard for the policy, or the metric never varies: check the data and "
                "the reward, raise max_num_gen_batches (0 = no cap) or lower data.train_batch_size")
        t0 = time.perf_counter()
        table = _new_round(generate_round, r, seen, short)
        t1 = time.perf_counter()
        scores, extras = score_round(table)
        survivors, groups_r, flat_r = _survivors(table, scores, extras, metric, overlong)
        score_s += time.perf_counter() - t1
        gen_s += t1 - t0
        n_tokens += sum(table.column("response_len").to_pylist())
        kept.append(survivors)
        n_kept, n_gen, n_flat, r = n_kept + groups_r - flat_r, n_gen + groups_r, n_flat + flat_r, r + 1
    out = _first_groups(pa.concat_tables(kept), want_groups)
    return out, {
        "filter_groups/num_gen_batches": float(r),
        "filter_groups/gen_groups": float(n_gen),
        "filter_groups/gen_dropped_groups": float(n_flat),
        "filter_groups/gen_dropped_frac": n_flat / max(n_gen, 1),
        "filter_groups/kept_groups": float(want_groups),
        "filter_groups/surplus_groups": float(n_kept - want_groups),
        "filter_groups/gen_response_tokens": float(n_tokens),
        "timing_s/gen": gen_s,
        "timing_s/filter_reward": score_s,
    }
