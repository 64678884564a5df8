"""DAPO dynamic sampling: which metric is filtered on, and the batch refill across rounds.

No model: generate_round / score_round are small callables that build SAMPLE_SCHEMA tables
through the real `sample_table`, with scores decided by the dataset row.
"""

from __future__ import annotations

import functools
import json

import pyarrow as pa
import pytest
import torch

from gpu_jobs.algos import overlong_penalty
from gpu_jobs.stages.dynamic_sampling import (
    DynamicSamplingError,
    PromptsExhaustedError,
    refill_rounds,
    refill_settings,
    round_plan,
    round_rows,
    round_seed,
    round_tag,
)
from gpu_jobs.stages.samples import SAMPLE_SCHEMA, sample_table
from gpu_jobs.data import PromptSampler

K = 1  # the iteration the fakes generate for


def round_table(rows: list[int], r: int, n: int = 2, lengths: tuple[int, ...] = (3, 4), k: int = K) -> pa.Table:
    """What an engine would give for `rows`: n responses per prompt, response j has lengths[j] tokens."""
    prompts = [{"row": row, "data_source": "toy", "reward_model": {"ground_truth": "1"}, "extra_info": {"row": row}}
               for row in rows]
    out = [{"prompt_index": i, "sample_index": j, "prompt_ids": [1, 2], "response_ids": [7] * lengths[j],
            "rollout_logprobs": [-0.1] * lengths[j], "finish_reason": "stop"}
           for i in range(len(rows)) for j in range(n)]
    return sample_table(out, prompts, k, tag=round_tag(r))


def fake_generate(rounds: dict[int, list[int]], calls: list[int], **kw):
    def generate_round(r: int) -> pa.Table:
        calls.append(r)
        if r not in rounds:
            raise PromptsExhaustedError(f"no round {r}")
        return round_table(rounds[r], r, **kw)
    return generate_round


def fake_score(flat: set[int]):
    """Rows in `flat` score 1.0 on every response (a flat group); others alternate 0, 1."""
    def score_round(table: pa.Table):
        rows = [json.loads(e)["row"] for e in table.column("extra_info").to_pylist()]
        scores = [1.0 if row in flat else float(j % 2)
                  for row, j in zip(rows, table.column("sample_index").to_pylist())]
        return scores, [{"acc": s} for s in scores]
    return score_round


def groups(table: pa.Table) -> list[str]:
    return list(dict.fromkeys(table.column("group_id").to_pylist()))


ROUNDS = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9, 10, 11], 3: [12, 13, 14, 15]}
FLAT = {0, 1, 2, 4, 5}


# ----------------------------------------------------------------------------- refill
def test_refill_stops_after_the_round_that_fills_the_batch_and_trims():
    calls: list[int] = []
    table, m = refill_rounds(fake_generate(ROUNDS, calls), fake_score(FLAT), metric="score", want_groups=4)
    # Round 0 keeps row 3 (1 group), round 1 rows 6, 7 (3 so far), round 2 all four (7 >= 4): stop,
    # never generating round 3, and keep the first 4 groups in round order.
    assert calls == [0, 1, 2]
    assert groups(table) == ["1-3", "r1-1-6", "r1-1-7", "r2-1-8"]
    assert len(table) == 8 and table.schema.equals(SAMPLE_SCHEMA)
    assert {k: v for k, v in m.items() if not k.startswith("timing_s/")} == {
        "filter_groups/num_gen_batches": 3.0, "filter_groups/gen_groups": 12.0,
        "filter_groups/gen_dropped_groups": 5.0, "filter_groups/gen_dropped_frac": 5 / 12,
        "filter_groups/kept_groups": 4.0, "filter_groups/surplus_groups": 3.0,  # 7 survivors - 4
        "filter_groups/gen_response_tokens": 84.0}  # 3 rounds x 4 prompts x (3 + 4) tokens, dropped ones too


def test_refill_cap_counts_the_first_round():
    # The same data needs 3 rounds: a cap of 3 is enough (verl checks the cap only when short)...
    table, m = refill_rounds(fake_generate(ROUNDS, []), fake_score(FLAT), metric="score", want_groups=4, max_rounds=3)
    assert m["filter_groups/num_gen_batches"] == 3.0 and len(groups(table)) == 4
    # ...a cap of 2 raises after round 1 with 3 of the 4 groups, naming the knobs.
    calls: list[int] = []
    with pytest.raises(DynamicSamplingError, match=r"2 generation round\(s\) left 3 of the 4 groups.*metric='score' "
                                                   r"\(5 of 8 groups were flat\).*max_num_gen_batches=2"):
        refill_rounds(fake_generate(ROUNDS, calls), fake_score(FLAT), metric="score", want_groups=4, max_rounds=2)
    assert calls == [0, 1]


def test_no_cap_stops_when_the_dataset_is_exhausted():
    # 12 rows, batches of 4: rounds 0, 1, 2 generate every row once; all flat, so round 3 has
    # nothing new and the refill raises instead of looping (max_rounds=0 is no cap).
    sampler = PromptSampler(seed=0, batch_size=4, n_rows=12)
    calls: list[int] = []
    seen: list[int] = []

    def generate_round(r):
        calls.append(r)
        plan = round_plan(sampler, 2, r, base_seed=123)
        seen.extend(plan.rows)
        return round_table(plan.rows, r, k=2)

    with pytest.raises(DynamicSamplingError, match="every prompt of the dataset.*lower data.train_batch_size"):
        refill_rounds(generate_round, fake_score(set(range(12))), metric="score", want_groups=1, max_rounds=0)
    assert calls == [0, 1, 2, 3] and sorted(seen) == list(range(12))


def test_refill_is_deterministic_and_round_zero_is_the_sampler_batch():
    sampler = PromptSampler(seed=7, batch_size=4, n_rows=40)

    def run():
        def generate_round(r):
            return round_table(round_plan(sampler, 3, r, base_seed=99).rows, r, k=3)
        return refill_rounds(generate_round, fake_score(set(range(0, 40, 2))), metric="score", want_groups=4)

    (a, ma), (b, mb) = run(), run()
    assert a.equals(b) and {k: v for k, v in ma.items() if "timing" not in k} == \
        {k: v for k, v in mb.items() if "timing" not in k}
    # Odd rows survive; the round-0 survivors are the sampler's odd rows for iteration 3, in order.
    odd0 = [f"3-{row}" for row in sampler.indices(2) if row % 2]
    assert odd0 and groups(a)[:min(4, len(odd0))] == odd0[:4]


def test_refill_filters_on_the_configured_metric():
    # Row 0's scores vary (0, 1) but its acc is constant; row 1 the other way round.
    def score_round(table):
        rows = [json.loads(e)["row"] for e in table.column("extra_info").to_pylist()]
        idx = table.column("sample_index").to_pylist()
        return ([float(j) if row == 0 else 1.0 for row, j in zip(rows, idx)],
                [{"acc": 1.0 if row == 0 else float(j)} for row, j in zip(rows, idx)])

    gen = lambda r: round_table([0, 1], r)  # noqa: E731
    assert groups(refill_rounds(gen, score_round, metric="score", want_groups=1)[0]) == ["1-0"]
    assert groups(refill_rounds(gen, score_round, metric="acc", want_groups=1)[0]) == ["1-1"]
    with pytest.raises(ValueError, match="metric='pass' is not in"):
        refill_rounds(gen, score_round, metric="pass", want_groups=1)


def test_refill_seq_reward_includes_the_overlong_penalty():
    # Every response scores 1.0, but with L=4, B=2 lengths 3 and 4 get penalties -0.5 and -1.0:
    # flat on 'score', not on 'seq_reward'.
    pen = functools.partial(overlong_penalty, max_response_length=4, overlong_buffer_len=2, penalty_factor=1.0)
    gen = lambda r: round_table([0, 1], r, lengths=(3, 4))  # noqa: E731
    table, _ = refill_rounds(gen, fake_score({0, 1}), metric="seq_reward", want_groups=2, max_rounds=1, overlong=pen)
    assert groups(table) == ["1-0", "1-1"]
    with pytest.raises(DynamicSamplingError, match="0 of the 2 groups"):
        refill_rounds(gen, fake_score({0, 1}), metric="score", want_groups=2, max_rounds=1, overlong=pen)


def test_refill_refuses_tables_it_cannot_keep_apart():
    # Row 0 is flat, so a round 1 is generated; built without its tag it reuses round 0's group id.
    with pytest.raises(ValueError, match="repeats group ids"):
        refill_rounds(lambda r: round_table([0], 0), fake_score({0}), metric="score", want_groups=1)
    with pytest.raises(TypeError, match="SAMPLE_SCHEMA"):
        refill_rounds(lambda r: round_table([0], r).drop_columns(["uid"]), fake_score(set()), metric="score",
                      want_groups=1)
    with pytest.raises(ValueError, match="1 scores and 1 extras for 2 rows"):
        refill_rounds(lambda r: round_table([0], r), lambda t: ([1.0], [{}]), metric="score", want_groups=1)
    with pytest.raises(ValueError, match="want_groups >= 1"):
        refill_rounds(lambda r: round_table([0], r), fake_score(set()), metric="score", want_groups=0)


# ----------------------------------------------------------------------------- rounds
def test_round_rows_cover_the_dataset_once_per_iteration():
    sampler = PromptSampler(seed=0, batch_size=4, n_rows=10)
    r0, r1, r2 = (round_rows(sampler, 3, r) for r in range(3))
    assert r0 == sampler.indices(2)  # round 0 is exactly the batch without refill
    # The 6 rows round 0 left: a chunk of 4, then the last 2; together every row exactly once.
    assert (len(r1), len(r2)) == (4, 2) and sorted(r0 + r1 + r2) == list(range(10))
    with pytest.raises(PromptsExhaustedError, match="all generated in rounds 0..2"):
        round_rows(sampler, 3, 3)
    assert [round_rows(sampler, 3, r) for r in range(3)] == [r0, r1, r2]  # a pure function
    big = PromptSampler(seed=0, batch_size=4, n_rows=1000)
    assert round_rows(big, 1, 1) != round_rows(big, 2, 1)  # each iteration has its own extra stream
    with pytest.raises(ValueError, match="k >= 1"):
        round_rows(sampler, 0, 0)


def test_round_seed_and_tag():
    assert round_seed(123, 0) == 123 and round_tag(0) == ""  # round 0 samples as without refill
    seeds = {round_seed(123, r) for r in range(1, 50)}
    assert 123 not in seeds and len(seeds) == 49 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert round_seed(123, 5) == round_seed(123, 5) and round_tag(2) == "r2-"
    plan = round_plan(PromptSampler(seed=0, batch_size=4, n_rows=10), 1, 1, 123)
    assert (plan.seed, plan.tag) == (round_seed(123, 1), "r1-")


# ----------------------------------------------------------------------------- config -> stages
def dapo_config(example_path, *overrides):
    from flows.config import load_run_config

    return load_run_config(example_path.parent / "dapo_arith.yaml", list(overrides))


def test_refill_settings_from_the_run_config(example_path):
    s = refill_settings(dapo_config(example_path, "algorithm.filter_groups.max_num_gen_batches=5"))
    assert (s["metric"], s["want_groups"], s["max_rounds"]) == ("score", 64, 5)
    # dapo_arith: L=8, B=4, factor 0.5: a full-length response gets -0.5, one of 4 tokens 0.
    assert s["overlong"](torch.tensor([4, 8])).tolist() == [0.0, -0.5]
    assert refill_settings(dapo_config(example_path, "overlong_buffer.enable=false"))["overlong"] is None
    with pytest.raises(ValueError, match="filter_groups.enable is False"):
        refill_settings(dapo_config(example_path, "algorithm.filter_groups.enable=false"))


def scored(table: pa.Table, scores: list[float], extras: list[dict]) -> pa.Table:
    table = table.append_column("score", pa.array(scores, pa.float32()))
    return table.append_column("reward_extra", pa.array([json.dumps(e) for e in extras]))


def test_advantages_filter_on_the_metric_and_log_the_overlong_penalty(example_path):
    from gpu_jobs.stages.advantage_math import batch_advantages

    cfg = dapo_config(example_path, "algorithm.filter_groups.metric=acc", "overlong_buffer.log=true")
    # Two prompts, responses of 4 and 6 tokens; L=8, B=4, factor 0.5: 6 tokens exceed L-B=4 by 2,
    # so -2/4*0.5 = -0.25. Row 0's acc is (1, 1) although its scores differ: flat on acc, dropped.
    table = scored(round_table([0, 1], 0, lengths=(4, 6)), [1.0, 0.0, 1.0, 0.0],
                   [{"acc": 1}, {"acc": 1}, {"acc": 1}, {"acc": 0}])
    out, m = batch_advantages(table, cfg, None)
    assert groups(out) == ["1-1"]
    assert out.column("overlong_reward").to_pylist() == [0.0, -0.25]
    assert out.column("overlong").to_pylist() == [False, True]
    assert m["reward/overlong_frac"] == 0.5 and m["reward/overlong_penalty_mean"] == pytest.approx(-0.125)
    assert m["filter_groups/dropped_groups"] == 1.0
    # On 'score' both groups vary; without log no extra columns.
    cfg = dapo_config(example_path)
    out, m = batch_advantages(table, cfg, None)
    assert groups(out) == ["1-0", "1-1"] and "overlong" not in out.column_names and "reward/overlong_frac" not in m
