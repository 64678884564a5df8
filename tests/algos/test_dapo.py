import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_jobs.algos import filter_groups, filter_metric, overlong_penalty


def test_filter_groups_hand():
    # a: (1, 1) has no variance -> dropped; b: (0, 1) kept; c: singleton kept (verl)
    keep, m = filter_groups(["a", "a", "b", "b", "c"], torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]))
    assert keep.tolist() == [False, False, True, True, True]
    assert m["filter_groups/dropped_groups"].item() == 1 and m["filter_groups/num_groups"].item() == 3
    assert m["filter_groups/dropped_frac"].item() == pytest.approx(1 / 3)


@settings(max_examples=30, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=12))
def test_filter_groups_property(rows):
    index, scores = [r[0] for r in rows], [r[1] for r in rows]
    keep, m = filter_groups(index, scores)
    for k in set(index):
        members = [i for i, x in enumerate(index) if x == k]
        flat = len(members) > 1 and len({scores[i] for i in members}) == 1
        assert all(bool(keep[i]) == (not flat) for i in members)  # whole groups, never part of one
    assert m["filter_groups/num_groups"].item() == len(set(index))


def test_overlong_penalty_hand():
    # L=10, B=4: free up to 6, then -(len-6)/4 * factor
    p = overlong_penalty(torch.tensor([5, 6, 8, 10]), max_response_length=10, overlong_buffer_len=4, penalty_factor=1.0)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([1]), 10, 0, 1.0)


# ----------------------------------------------------------------------------- filter_metric
def test_filter_metric_score_and_sequence_rewards():
    scores, extras, pen = [1.0, 0.0, 1.0], [{}, {}, {}], torch.tensor([0.0, 0.0, -0.5])
    assert filter_metric("score", scores, extras, pen).tolist() == [1.0, 0.0, 1.0]  # before shaping
    # verl's seq_reward is token_level_scores: the DAPO reward manager has added the penalty in.
    assert filter_metric("seq_reward", scores, extras, pen).tolist() == [1.0, 0.0, 0.5]
    assert filter_metric("seq_final_reward", scores, extras, pen).tolist() == [1.0, 0.0, 0.5]
    assert filter_metric("seq_reward", scores, extras).tolist() == [1.0, 0.0, 1.0]  # shaping off


def test_filter_metric_reads_the_reward_extra():
    extras = [{"acc": True, "fmt": 1}, {"acc": False, "fmt": 0.5}]
    assert filter_metric("acc", [0.3, 0.7], extras).tolist() == [1.0, 0.0]  # bools count as 0/1
    assert filter_metric("fmt", [0.3, 0.7], extras).tolist() == [1.0, 0.5]
    # A plain-float reward function leaves no 'acc': verl's DAPO manager records acc = score.
    assert filter_metric("acc", [0.3, 0.7], [{}, {"acc": 1}]).tolist() == [0.3, 1.0]


def test_filter_metric_unknown_key_names_the_available_ones():
    extras = [{"acc": 1, "fmt": 0}, {"acc": 0}]
    with pytest.raises(ValueError, match=r"metric='fmt' is not in .* row 1 .* 'seq_reward'.*\['acc'\]"):
        filter_metric("fmt", [1.0, 0.0], extras)
    with pytest.raises(ValueError, match="must be a number"):
        filter_metric("fmt", [1.0], [{"fmt": "yes"}])
    with pytest.raises(ValueError, match="2 scores but 1"):
        filter_metric("score", [1.0, 0.0], [{}])


def test_failed_reward_call_is_nan_and_keeps_its_group():
    # Row 1's reward call failed (no keys but the error): its acc is unknown, not 0.
    extras = [{"acc": 1}, {"error": "boom", "error_kind": "timeout"}, {"acc": 1}, {"acc": 1}]
    values = filter_metric("acc", [1.0, 0.0, 1.0, 1.0], extras)
    assert values[0] == 1.0 and values[1].isnan()
    # Group a (1, NaN) may or may not be flat: kept; group b (1, 1) is flat: dropped.
    keep, m = filter_groups(["a", "a", "b", "b"], values)
    assert keep.tolist() == [True, True, False, False] and m["filter_groups/dropped_groups"].item() == 1
