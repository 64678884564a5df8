"""Feedback rows -> DPO pairs and KTO examples (gpu_jobs/data/preferences.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_jobs.data.preferences import KTO_COUNTS, PAIR_COUNTS, kto_examples, preference_pairs
from gpu_jobs.registry import UnknownNameError


def row(aid: str, index: int = 0, *, prompt: str = "12+34=", response: str = "46", ids=None, thumbs=(),
        reward=None, preferred_over=(), version: str = "v1") -> dict:
    """A row shaped like gpu_jobs.online.dataset.training_rows' (the fields the builders read)."""
    return {"prompt": [{"role": "user", "content": prompt}], "data_source": "rlmill/feedback/arith",
            "extra_info": {"answer_id": aid, "index": index, "version": version, "response": response,
                           "response_ids": list(ids if ids is not None else [ord(c) for c in response]),
                           "thumbs": list(thumbs), "reward": reward, "preferred_over": list(preferred_over),
                           "rejected_for": []}}


def test_a_vote_makes_a_pair():
    rows = [row("a", 0, response="46", preferred_over=["a#1"]), row("a", 1, response="47", version="v2")]
    pairs, counts = preference_pairs(rows)
    assert len(pairs) == 1
    p = pairs[0]
    assert (p.chosen, p.rejected, p.chosen_ref, p.rejected_ref) == ("46", "47", "a#0", "a#1")
    assert p.chosen_ids == [ord("4"), ord("6")] and p.rejected_ids == [ord("4"), ord("7")]
    assert (p.chosen_version, p.rejected_version, p.votes) == ("v1", "v2", 1)
    assert p.prompt == [{"role": "user", "content": "12+34="}]
    assert counts == {**dict.fromkeys(PAIR_COUNTS, 0), "votes": 1, "pairs": 1}


def test_a_pair_seen_twice_is_one_pair():
    rows = [row("a", 0, preferred_over=["b#0", "b#0"]), row("b", 0, response="47")]
    pairs, counts = preference_pairs(rows)
    assert len(pairs) == 1 and pairs[0].votes == 2
    assert counts["votes"] == 2 and counts["duplicate_votes"] == 1 and counts["pairs"] == 1


def test_opposite_votes_majority_wins_and_a_tie_is_dropped():
    # a beats b twice, b beats a once: one pair a > b with a net vote of 1
    rows = [row("a", 0, preferred_over=["b#0", "b#0"]), row("b", 0, response="47", preferred_over=["a#0"])]
    pairs, counts = preference_pairs(rows)
    assert [(p.chosen_ref, p.rejected_ref, p.votes) for p in pairs] == [("a#0", "b#0", 1)]
    assert counts["outvoted_votes"] == 1 and counts["duplicate_votes"] == 1 and counts["votes"] == 3
    # the minority direction listed first still yields the majority's pair
    rows = [row("b", 0, response="47", preferred_over=["a#0"]), row("a", 0, preferred_over=["b#0", "b#0"])]
    assert [(p.chosen_ref, p.rejected_ref) for p in preference_pairs(rows)[0]] == [("a#0", "b#0")]
    # one vote each way says nothing
    rows = [row("a", 0, preferred_over=["b#0"]), row("b", 0, response="47", preferred_over=["a#0"])]
    pairs, counts = preference_pairs(rows)
    assert pairs == [] and counts["tied"] == 1 and counts["pairs"] == 0


def test_dropped_pairs_are_counted_by_reason():
    rows = [
        row("a", 0, preferred_over=["gone#0"]),                          # the loser is not in the rows
        row("b", 0, response="46", preferred_over=["c#0", "d#0", "b#0"]),
        row("c", 0, response="46"),                                      # same text as b
        row("d", 0, response="4 6", ids=[ord("4"), ord("6")]),           # other text, same tokens as b
        row("e", 0, prompt="1+1=", response="2", preferred_over=["f#0"]),
        row("f", 0, prompt="2+2=", response="5"),                        # another prompt
    ]
    pairs, counts = preference_pairs(rows)
    assert pairs == []
    assert counts == {**dict.fromkeys(PAIR_COUNTS, 0), "votes": 5, "missing_answer": 1, "identical": 3,
                      "different_prompt": 1}  # b over itself is identical too


def test_rows_read_back_from_parquet_with_arrays():
    rows = [row("a", 0, preferred_over=["a#1"]), row("a", 1, response="47")]
    for r in rows:
        e = r["extra_info"]
        e["response_ids"] = np.array(e["response_ids"], dtype=np.int64)
        e["preferred_over"] = np.array(e["preferred_over"], dtype=object)
        e["thumbs"] = np.array([], dtype=object)
        e["index"] = np.int32(e["index"])
        r["prompt"] = np.array(r["prompt"], dtype=object)
    pairs, _ = preference_pairs(rows)
    assert pairs[0].chosen_ids == [ord("4"), ord("6")] and type(pairs[0].chosen_ids[0]) is int
    assert pairs[0].prompt == [{"role": "user", "content": "12+34="}] and pairs[0].rejected_ref == "a#1"


def test_bad_rows_are_refused_before_any_work():
    good = row("a", 0)
    broken = row("b", 0)
    del broken["extra_info"]["response_ids"]
    with pytest.raises(ValueError, match=r"feedback row 1 has no extra_info\['response_ids'\]: pass the rows of"):
        preference_pairs([good, broken])
    with pytest.raises(ValueError, match="feedback row 0 has no prompt, extra_info"):
        kto_examples([{"extra_info": "?"}])
    with pytest.raises(ValueError, match="answer a#0 appears in two feedback rows"):
        kto_examples([good, row("a", 0, thumbs=["up"])])


# ------------------------------------------------------------------------------------------ KTO


def test_kto_labels_from_thumbs_majority():
    rows = [row("a", 0, thumbs=["up", "up", "down"]), row("b", 0, thumbs=["down"]),
            row("c", 0, thumbs=["up", "down"]), row("d", 0, reward=1.0), row("e", 0, thumbs=["up"], response="x")]
    examples, counts = kto_examples(rows)
    assert [(x.ref, x.desirable) for x in examples] == [("a#0", True), ("b#0", False), ("e#0", True)]
    assert examples[2].completion == "x" and examples[2].completion_ids == [ord("x")]
    assert examples[0].prompt == [{"role": "user", "content": "12+34="}] and examples[0].version == "v1"
    assert counts == {"rows": 5, "desirable": 2, "undesirable": 1, "tied": 1, "unlabeled": 1}
    assert set(counts) == set(KTO_COUNTS)


def test_kto_labels_from_reward_threshold():
    # d has no reward; e's missing reward came back through pandas as NaN, which is not a low reward
    rows = [row("a", 0, reward=0.8), row("b", 0, reward=0.2), row("c", 0, reward=0.5), row("d", 0),
            row("e", 0, reward=float("nan"))]
    examples, counts = kto_examples(rows, label_from="reward", reward_threshold=0.5)
    assert [(x.ref, x.desirable) for x in examples] == [("a#0", True), ("b#0", False)]
    assert counts == {"rows": 5, "desirable": 1, "undesirable": 1, "tied": 1, "unlabeled": 2}
    with pytest.raises(ValueError, match="label_from='reward' needs reward_threshold"):
        kto_examples(rows, label_from="reward")
    with pytest.raises(ValueError, match="reward_threshold does nothing with label_from='thumbs'"):
        kto_examples(rows, reward_threshold=0.5)
    with pytest.raises(UnknownNameError, match="valid names are: reward, thumbs"):
        kto_examples(rows, label_from="stars")


# -------------------------------------------------- through the real feedback segments and rows


def test_from_committed_feedback_segments(tmp_path):
    """Answers and feedback committed as the consumer commits them, read by training_rows."""
    import time

    from gpu_jobs.online.consumer import FEEDBACK_DIR, SEGMENT_KIND, _commit_segment, hour_of
    from gpu_jobs.online.dataset import training_rows
    from gpu_jobs.online.events import answer_event, answers_table, feedback_event, feedback_table

    now = time.time()
    choices = [{"index": i, "text": t, "token_ids": [ord(c) for c in t], "logprobs": [-0.5] * len(t),
                "finish_reason": "stop"} for i, t in enumerate(["46", "47"])]
    answers = [answer_event("ans-1", endpoint="chat", model="arith", version="v3", created=now, latency_s=0.1,
                            prompt=[{"role": "user", "content": "12+34="}], prompt_ids=[1, 2], choices=choices,
                            sampling={"n": 2})]
    feedback = [feedback_event("ans-1", model="arith", version="v3", index=0, preferred_over="ans-1",
                               preferred_over_index=1, user="u1"),
                feedback_event("ans-1", model="arith", version="v3", index=0, thumbs="up", user="u1"),
                feedback_event("ans-1", model="arith", version="v3", index=1, thumbs="down", user="u2")]
    dest = f"{tmp_path}/{FEEDBACK_DIR}/arith/{hour_of(now)}/segment-{answers[0]['event_id']}"
    _commit_segment(dest, {"answers": answers_table(answers), "feedback": feedback_table(feedback)}, SEGMENT_KIND,
                    {"event_ids": [e["event_id"] for e in answers + feedback], "answer_ids": ["ans-1"]})
    rows = training_rows(str(tmp_path), "arith")
    pairs, counts = preference_pairs(rows)
    assert [(p.chosen, p.rejected, p.chosen_ref, p.rejected_ref, p.chosen_version) for p in pairs] == \
        [("46", "47", "ans-1#0", "ans-1#1", "v3")]
    assert pairs[0].prompt == [{"role": "user", "content": "12+34="}] and counts["votes"] == 1
    examples, _ = kto_examples(rows)
    assert [(x.completion, x.desirable) for x in examples] == [("46", True), ("47", False)]
    by_reward, _ = kto_examples(rows, label_from="reward", reward_threshold=0.5)
    assert [(x.completion, x.desirable) for x in by_reward] == [("46", True), ("47", False)]


# ------------------------------------------------------------------ feedback -> a preference run's file
@pytest.mark.parametrize("algorithm", ["dpo", "kto"])
def test_feedback_becomes_a_file_a_preference_run_reads(tmp_path, algorithm):
    """What a retrain does with a window's rows: pairs (or thumbs) -> TRL rows -> Parquet ->
    the run's preference_frames, which holds out val_size rows and keeps the rest in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flows.config import load_run_config
    from gpu_jobs.data.preferences import preference_file_rows
    from gpu_jobs.stages.preference_data import preference_frames

    rows = [r for i in range(6) for r in (row(f"q{i}", 0, prompt=f"{10 + i}+1=", response=str(11 + i),
                                              thumbs=["up"], preferred_over=[f"q{i}#1"]),
                                          row(f"q{i}", 1, prompt=f"{10 + i}+1=", response="0", thumbs=["down"]))]
    items = preference_pairs(rows)[0] if algorithm == "dpo" else kto_examples(rows)[0]
    url = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist(preference_file_rows(items)), url)
    cfg = load_run_config(None, [f"root={tmp_path}", f"preference.algorithm={algorithm}", f"preference.train_files=[{url}]",
                                 "preference.val_size=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                 "actor.ppo_micro_batch_size_per_gpu=2"])
    train, val = preference_frames(cfg)
    n = 6 if algorithm == "dpo" else 12
    assert (len(val), len(train)) == (2, n - 2)
    first = train.iloc[0].to_dict()
    if algorithm == "dpo":
        assert (first["prompt"], first["chosen"], first["rejected"]) == ([{"role": "user", "content": "12+1="}], "13", "0")
    else:
        assert (first["prompt"], first["completion"], bool(first["label"])) == ([{"role": "user", "content": "11+1="}],
                                                                               "12", True)


def test_generated_arith_preferences():
    from gpu_jobs.data.preferences import arith_preference_rows

    pairs = arith_preference_rows("dpo", [(12, 30), (50, 49)], seed=3)
    assert [p["chosen"] for p in pairs] == ["42", "99"]
    assert all(1 <= abs(int(p["rejected"]) - int(p["chosen"])) <= 10 for p in pairs)
    kto = arith_preference_rows("kto", [(12, 30), (50, 49)], seed=3)
    assert [(x["completion"] == str(a + b), x["label"]) for x, (a, b) in zip(kto, [(12, 30), (50, 49)])] == \
        [(True, True), (False, False)]
