"""verl reward files work unchanged: any finite score is kept, and the ground truth reaches
`compute_score` exactly as the dataset held it (a list as a list, a dict as a dict), through the
real path: prompt rows -> sample table (Parquet, committed) -> the reward stage -> score_batch."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
from pydantic import ValidationError

from gpu_jobs.reward import RewardConfig, decode_ground_truth, encode_ground_truth, score_batch

VERL_REWARD = textwrap.dedent(
    '''
    """As verl users write them: -1 for a wrong format, 0 wrong, 1 right; any ground-truth type."""
    import math

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "inf":
            return math.inf
        if not solution_str.startswith("A:"):
            return -1.0                      # format penalty, outside [0, 1]
        answer = solution_str[2:].strip()
        if isinstance(ground_truth, list):
            ok = answer in ground_truth
        elif isinstance(ground_truth, dict):
            ok = answer == ground_truth["answer"] or answer in ground_truth.get("aliases", [])
        else:
            ok = answer == str(ground_truth)
        return {"score": 1.0 if ok else 0.0, "gt_type": type(ground_truth).__name__, "gt": ground_truth}
    '''
)


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARD)
    return str(path)


def _cfg(path: str, **kw) -> RewardConfig:
    return RewardConfig(custom_reward_function={"path": path}, num_workers=1, timeout_s=20.0, **kw)


def test_a_negative_verl_score_is_kept_by_default(verl_file):
    assert RewardConfig().score_range is None
    rows = [{"data_source": "my/src", "solution_str": s, "ground_truth": "7"} for s in ("7", "A: 7", "A: 8", "inf")]
    scores, extras, metrics = score_batch(rows, _cfg(verl_file))
    assert scores[:3] == [-1.0, 1.0, 0.0]
    assert extras[0] == {} and metrics["reward/errors"] == 1  # only the infinite score is an error
    assert extras[3]["error_kind"] == "invalid" and "not finite" in extras[3]["error"]
    assert metrics["critic/score/min"] == -1.0


def test_the_range_check_is_opt_in(verl_file):
    scores, extras, metrics = score_batch(
        [{"data_source": "my/src", "solution_str": "7", "ground_truth": "7"}],
        _cfg(verl_file, score_range=(0.0, 1.0), on_error=0.0))
    assert scores == [0.0] and "outside the declared score_range" in extras[0]["error"]
    with pytest.raises(ValidationError, match="on_error=-1.0 lies outside score_range"):
        RewardConfig(score_range=(0.0, 1.0), on_error=-1.0)
    assert RewardConfig(on_error=-1.0).on_error == -1.0


@pytest.mark.parametrize("value", [
    "7", "", "  spaced ", ["7", "seven"], [], {"answer": "7", "aliases": ["seven"]}, {}, 7, 2.5, True,
    [[1, 2], {"a": None}], "\x00rlmill-json:[1]", "[1, 2]", '{"answer": 1}', "null",
])
def test_encode_then_decode_gives_back_the_value(value):
    cell = encode_ground_truth(value)
    assert isinstance(cell, str)
    assert decode_ground_truth(cell) == value and type(decode_ground_truth(cell)) is type(value)
    if isinstance(value, str) and not value.startswith("\x00"):
        assert cell == value  # strings are stored as they are


def test_numpy_values_from_parquet_decode_to_plain_python():
    assert decode_ground_truth(encode_ground_truth(np.array(["7", "seven"], dtype=object))) == ["7", "seven"]
    assert decode_ground_truth(encode_ground_truth({"answer": np.int64(7), "v": np.arange(2)})) == {"answer": 7, "v": [0, 1]}
    assert decode_ground_truth(encode_ground_truth((1, 2))) == [1, 2]
    assert encode_ground_truth(None) == ""
    assert decode_ground_truth("plain") == "plain" and decode_ground_truth(None) is None


class _CharTokenizer:
    """batch_decode for the stub context: token ids are character codes."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(chr, x)) for x in ids]


GROUND_TRUTHS = [["7", "seven"], {"answer": "7", "aliases": ["seven"]}, "7", 7, np.array(["7", "sept"], dtype=object)]


def test_list_and_dict_ground_truths_reach_the_function_unchanged_through_the_reward_path(verl_file, tmp_path):
    """Prompt rows -> sample_table -> committed Parquet -> the reward stage's rows -> score_batch."""
    from gpu_jobs.stages.samples import sample_table
    from gpu_jobs.stages.scoring import reward_rows  # what the reward stage scores
    from storage import RunLayout, read_table, write_table

    prompts = [{"data_source": "my/src", "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {"index": i}, "row": i} for i, gt in enumerate(GROUND_TRUTHS)]
    responses = ["A: seven", "A: seven", "A: 7", "A: 7", "sept"]  # the last one is malformed: -1
    engine_rows = [{"prompt_index": i, "sample_index": 0, "prompt_ids": [1, 2], "response_ids": [ord(c) for c in r],
                    "rollout_logprobs": [-0.5] * len(r), "finish_reason": "stop"} for i, r in enumerate(responses)]
    layout = RunLayout(str(tmp_path / "root"), "r")
    batch_uri = write_table(layout.stage(1, "gate"), sample_table(engine_rows, prompts, 1))
    table = read_table(batch_uri, columns=["uid", "data_source", "response_ids", "ground_truth", "extra_info"])
    scores, extras, metrics = score_batch(reward_rows(_CharTokenizer(), table), _cfg(verl_file))
    assert scores == [1.0, 1.0, 1.0, 1.0, -1.0] and metrics["reward/errors"] == 0
    assert [e.get("gt_type") for e in extras[:4]] == ["list", "dict", "str", "int"]
    assert extras[0]["gt"] == ["7", "seven"] and extras[1]["gt"] == {"answer": "7", "aliases": ["seven"]}
    assert extras[2]["gt"] == "7" and extras[3]["gt"] == 7
    # The committed sample table keeps string ground truths as they are.
    stored = table.column("ground_truth").to_pylist()
    assert stored[2] == "7" and decode_ground_truth(stored[4]) == ["7", "sept"]


def test_builtin_scorers_still_get_their_string_ground_truths():
    from gpu_jobs.stages.samples import ground_truth_of

    rows = [{"data_source": "rlmill/arith", "solution_str": "82",
             "ground_truth": ground_truth_of({"style": "rule", "ground_truth": gt})} for gt in ("82", 82)]
    scores, _, metrics = score_batch(rows, RewardConfig())
    assert scores == [1.0, 1.0] and metrics["reward/errors"] == 0
    assert not math.isnan(metrics["critic/score/mean"])
