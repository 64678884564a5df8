"""verl-format prompt datasets: generators, round trips on every backend, sampling, rendering."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from storage.datasets import read_prompts, write_prompts
from gpu_jobs.data import DatasetConfig, OverlongPromptError, PromptSampler, epoch_and_step, epoch_permutation, get_generator, make_dataset, register_generator, render_prompt, render_prompts, sample_batch


@pytest.fixture(scope="module")
def tokenizer():
    from gpu_jobs.models.tokenizer import build_tokenizer

    return build_tokenizer()


def _records(df: pd.DataFrame) -> list[dict]:
    return df.to_dict("records")


# ---------------------------------------------------------------------------------- generators
def test_arith_rows_follow_the_contract(tmp_path):
    train_url, test_url = make_dataset("arith", str(tmp_path / "arith"), train_size=200, test_size=20, seed=0)
    assert train_url.endswith("/train.parquet") and test_url.endswith("/test.parquet")
    df = read_prompts(train_url)
    assert len(df) == 200 and list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    for row in _records(df):
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["data_source"] == "rlmill/arith" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
        assert row["extra_info"]["split"] == "train"
    assert sorted(df["extra_info"].map(lambda e: e["index"])) == list(range(200))


def test_make_dataset_is_deterministic_and_test_is_held_out(tmp_path):
    a = make_dataset("arith", str(tmp_path / "a"), train_size=300, test_size=50, seed=7)
    b = make_dataset("arith", str(tmp_path / "b"), train_size=300, test_size=50, seed=7)
    c = make_dataset("arith", str(tmp_path / "c"), train_size=300, test_size=50, seed=8)
    for ua, ub in zip(a, b):
        assert _records(read_prompts(ua)) == _records(read_prompts(ub))
    assert _records(read_prompts(a[0])) != _records(read_prompts(c[0]))
    train = {r["prompt"][0]["content"] for r in _records(read_prompts(a[0]))}
    test = {r["prompt"][0]["content"] for r in _records(read_prompts(a[1]))}
    assert len(train) == 300 and len(test) == 50 and not train & test


def test_gsm_symbolic_rows_carry_the_entry_for_scoring(tmp_path):
    train_url, _ = make_dataset("gsm_symbolic", str(tmp_path / "gsm"), train_size=4, test_size=2, seed=3)
    again, _ = make_dataset("gsm_symbolic", str(tmp_path / "gsm2"), train_size=4, test_size=2, seed=3)
    df = read_prompts(train_url)
    assert _records(df) == _records(read_prompts(again))
    for row in _records(df):
        entry = json.loads(row["extra_info"]["rg_entry"])
        assert row["data_source"] == "reasoning_gym/gsm_symbolic"
        assert row["prompt"] == [{"role": "user", "content": entry["question"]}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(entry["answer"])}
        assert entry["metadata"]["source_dataset"] == "gsm_symbolic"


def test_any_reasoning_gym_task_by_name(tmp_path):
    train_url, test_url = make_dataset("rg:chain_sum", str(tmp_path / "cs"), train_size=3, test_size=2, seed=0)
    df = read_prompts(train_url)
    assert len(df) == 3 and set(df["data_source"]) == {"reasoning_gym/chain_sum"}
    assert len(read_prompts(test_url)) == 2


def test_an_empty_split_is_a_dataset_with_no_rows(tmp_path):
    _, test_url = make_dataset("rg:chain_sum", str(tmp_path), train_size=1, test_size=0, seed=0)
    df = read_prompts(test_url)
    assert len(df) == 0 and {"data_source", "prompt"} <= set(df.columns)


def test_unknown_generator_lists_known_names():
    with pytest.raises(KeyError, match="arith"):
        get_generator("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_generator("arith")(lambda split, size, seed: [])


# ---------------------------------------------------------------------------------- storage
def test_round_trip_on_every_backend(storage_root):
    out = f"{storage_root.url}/datasets/arith"
    train_url, test_url = make_dataset(
        "arith", out, train_size=64, test_size=16, seed=1, storage=storage_root.storage
    )
    df = read_prompts(train_url, storage=storage_root.storage)
    local = make_dataset("arith", "memory://rlmill-data-ref/arith", train_size=64, test_size=16, seed=1)
    assert _records(df) == _records(read_prompts(local[0]))
    both = read_prompts([train_url, test_url], storage=storage_root.storage)
    assert len(both) == 80 and list(both.index) == list(range(80))
    # nothing but the two committed files is left in the folder (no temporaries)
    from storage import url_to_fs

    fs, path = url_to_fs(out, storage_root.storage)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) == ["test.parquet", "train.parquet"]


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError, match="disk full"):
        row = {"data_source": "x", "prompt": [{"role": "user", "content": "q"}]}
        write_prompts([row], str(tmp_path / "d" / "t.parquet"))
    assert list((tmp_path / "d").iterdir()) == []


def test_verl_users_file_reads_unchanged(tmp_path):
    # What verl's examples/data_preprocess/gsm8k.py writes (HF datasets -> Parquet): nested
    # structs, extra_info with the question and answer text.
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"content": f"Q{i}? Think step by step; give the answer after '####'.", "role": "user"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(i * 3), "style": "rule"},
            "extra_info": {"answer": f"... #### {i * 3}", "index": i, "question": f"Q{i}?", "split": "train"},
        }
        for i in range(5)
    ]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    df = read_prompts(str(path))
    got = _records(df)[2]
    assert got["prompt"] == [{"role": "user", "content": rows[2]["prompt"][0]["content"]}]
    assert got["reward_model"] == {"ground_truth": "6", "style": "rule"}
    assert got["extra_info"]["index"] == 2 and isinstance(got["extra_info"]["index"], int)
    # a bare-text prompt column becomes one user message
    pd.DataFrame({"data_source": ["s"], "prompt": ["hello"]}).to_parquet(tmp_path / "raw.parquet")
    assert read_prompts(str(tmp_path / "raw.parquet")).loc[0, "prompt"] == [{"role": "user", "content": "hello"}]


def test_reading_a_non_verl_file_names_it(tmp_path):
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet.*data_source"):
        read_prompts(str(tmp_path / "bad.parquet"))


# ---------------------------------------------------------------------------------- sampling
def test_sampler_is_a_pure_function_of_seed_epoch_iteration():
    assert sample_batch(3, 17, 8, 100) == sample_batch(3, 17, 8, 100)
    assert PromptSampler(seed=3, batch_size=8, n_rows=100).indices(17) == sample_batch(3, 17, 8, 100)
    assert sample_batch(3, 17, 8, 100) != sample_batch(4, 17, 8, 100)


def test_sampler_batches_partition_each_epoch_then_roll_over():
    n, bs = 10, 4  # 2 batches per epoch; rows perm[8:10] of each epoch are skipped (drop_last)
    s = PromptSampler(seed=0, batch_size=bs, n_rows=n)
    assert s.steps_per_epoch == 2
    assert [epoch_and_step(k, bs, n) for k in range(5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    perm0, perm1 = epoch_permutation(0, 0, n).tolist(), epoch_permutation(0, 1, n).tolist()
    assert s.indices(0) == perm0[0:4] and s.indices(1) == perm0[4:8]
    assert s.indices(2) == perm1[0:4] and s.indices(3) == perm1[4:8]  # rollover: a new permutation
    assert perm0 != perm1 and sorted(perm0) == list(range(n))
    epoch0 = s.indices(0) + s.indices(1)
    assert len(set(epoch0)) == 8  # no row twice within an epoch


def test_sampler_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="larger than the dataset"):
        sample_batch(0, 0, 11, 10)
    with pytest.raises(ValueError, match="iteration"):
        sample_batch(0, -1, 2, 10)


# ---------------------------------------------------------------------------------- rendering
def test_render_prompt_uses_the_chat_template(tokenizer):
    ids = render_prompt([{"role": "user", "content": "37+45="}], tokenizer)
    assert tokenizer.decode(ids) == "37+45=" and len(ids) == 6
    with pytest.raises(OverlongPromptError, match="6 tokens > max_prompt_length=5"):
        render_prompt([{"role": "user", "content": "37+45="}], tokenizer, max_prompt_length=5)


def test_overlong_prompts_error_or_are_filtered_and_counted(tokenizer):
    prompts = [[{"role": "user", "content": c}] for c in ["1+2=", "12345+678=", "3+4="]]
    with pytest.raises(OverlongPromptError, match="row 1"):
        render_prompts(prompts, tokenizer, DatasetConfig(max_prompt_length=5))
    cfg = DatasetConfig(max_prompt_length=5, overlong_prompts="filter")
    ids, kept, n_filtered = render_prompts(prompts, tokenizer, cfg)
    assert kept == [0, 2] and n_filtered == 1 and [len(x) for x in ids] == [4, 4]


def test_times_holds_out_whole_facts_and_both_orders(tmp_path):
    """The real-model task: a held-out fact (7 x 8) is never trained on, not even as 8 x 7."""
    train_url, test_url = make_dataset("times", str(tmp_path / "t"), train_size=300, test_size=40, seed=3)
    train, test = read_prompts(train_url), read_prompts(test_url)
    facts = lambda df: {frozenset((e["a"], e["b"])) for e in df["extra_info"]}  # noqa: E731
    assert len(test) in (40, 41) and len(train) == 300 and not facts(test) & facts(train)
    assert len(facts(test)) + len(facts(train)) == 66  # every fact a <= b of 2..12 is in one split
    row = test.iloc[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"][0]["content"] == f"What is {a} times {b}? Answer with only the number."
    assert row["reward_model"]["ground_truth"] == str(a * b) and row["data_source"] == "rlmill/times"
    with pytest.raises(ValueError, match="121 prompts in all"):
        make_dataset("times", str(tmp_path / "u"), train_size=10, test_size=200, seed=3)


def test_times25_holds_out_200_never_trained_facts_and_scores_their_products(tmp_path):
    """The wide family: 200+ held-out prompts (one is half a point), whole facts in both orders,
    disjoint from training, every fact of 2..25 in one split, scored on the last number."""
    from gpu_jobs.reward.registry import default_compute_score as compute_score

    train_url, test_url = make_dataset("times25", str(tmp_path / "t"), train_size=1000, test_size=200, seed=0)
    train, test = read_prompts(train_url), read_prompts(test_url)
    facts = lambda df: {frozenset((e["a"], e["b"])) for e in df["extra_info"]}  # noqa: E731
    assert len(test) in (200, 201) and len(train) == 1000 and not facts(test) & facts(train)
    assert len(facts(test)) + len(facts(train)) == 300  # every fact a <= b of 2..25
    assert {e["a"] for e in test["extra_info"]} | {e["a"] for e in train["extra_info"]} == set(range(2, 26))
    row = test.iloc[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["data_source"] == "rlmill/times25" and row["reward_model"]["ground_truth"] == str(a * b)
    assert compute_score("rlmill/times25", f"It is {a * b}.", str(a * b)) == 1.0
    assert compute_score("rlmill/times25", f"It is {a * b + 1}.", str(a * b)) == 0.0
    with pytest.raises(ValueError, match="576 prompts in all"):
        make_dataset("times25", str(tmp_path / "u"), train_size=10, test_size=600, seed=0)


@pytest.mark.parametrize("name, most", [("times", 60), ("times25", 288)])
def test_a_times_run_config_refuses_a_held_out_set_it_cannot_hold(name, most):
    from flows.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=f"{name} has .* holds out at most {most}"):
        load_run_config(None, [f"data.generate={name}", f"data.val_size={most + 1}"])
