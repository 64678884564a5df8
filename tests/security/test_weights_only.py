"""Checkpoint files from storage are data: a torch file whose pickle would run code is refused.

The files a resume reads (gpu_jobs.train.checkpoint, reshard) load with weights_only=True;
DeepSpeed's own loaders (which pass weights_only=False) are forced to it inside
weights_only_loads(). What DeepSpeed legitimately pickles (its loss scaler, the ZeRO stage
enum) still loads.
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_jobs.train import reshard
from gpu_jobs.train.safe_load import load_weights_only, weights_only_loads


class _Payload:
    """Unpickling this runs a command that leaves a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def evil_file(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"x": torch.zeros(2)}, "hook": _Payload(str(marker))}, path)
    return str(path), marker


def test_a_pickle_with_code_is_refused_by_every_loader(evil_file):
    path, marker = evil_file
    with pytest.raises(Exception, match="Weights only load failed"):
        reshard._load(path)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_weights_only(path)
    with weights_only_loads(), pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path, weights_only=False)  # as DeepSpeed's checkpoint engine calls it
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the override ends with the block


def test_deepspeeds_own_objects_still_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "mp_rank_00_model_states.pt"
    state = {"module": {"w": torch.arange(4.0)}, "zero_stage": ZeroStageEnum.optimizer_states,
             "loss_scaler": LossScaler(1.0)}
    torch.save(state, path)
    loaded = load_weights_only(str(path))
    assert torch.equal(loaded["module"]["w"], state["module"]["w"])
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states and loaded["loss_scaler"].cur_scale == 1.0
