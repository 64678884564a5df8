import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_jobs.algos import filter_groups, overlong_penalty


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
