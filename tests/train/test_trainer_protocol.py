"""Every trainer class has every member of the protocol the stage layer drives it through
(gpu_jobs.train.protocol): a new trainer that misses one fails here, not in the middle of a run.
Checked on the classes (building one needs a model): methods and properties by name, data
members by a class attribute or annotation."""

from __future__ import annotations

import typing

import pytest

from gpu_jobs.train.critic import Critic
from gpu_jobs.train.pipeline import PipelinePolicyTrainer
from gpu_jobs.train.policy import AdapterOffRef, PolicyTrainer, RefModel
from gpu_jobs.train.protocol import ActorTrainer, CriticTrainer, LogProbModel, Trainer
from gpu_jobs.train.ranks.trainer import GroupTrainer


def _members(protocol: type) -> set[str]:
    """The protocol's own members and its bases', as typing.get_protocol_members (3.13) lists them."""
    out: set[str] = set()
    for base in protocol.__mro__:
        if base in (object, typing.Protocol, typing.Generic) or not getattr(base, "_is_protocol", False):
            continue
        out |= set(getattr(base, "__annotations__", {}))
        out |= {n for n, v in vars(base).items() if callable(v) and not n.startswith("_")}
    return out


def _missing(cls: type, protocol: type) -> list[str]:
    annotated = {n for k in cls.__mro__ for n in getattr(k, "__annotations__", {})}
    return sorted(m for m in _members(protocol) if not hasattr(cls, m) and m not in annotated)


# PolicyTrainer covers both the full fine-tuning and the LoRA trainer (PolicyTrainer(lora=...)).
@pytest.mark.parametrize("cls, protocol", [
    (PolicyTrainer, ActorTrainer), (PipelinePolicyTrainer, ActorTrainer), (GroupTrainer, ActorTrainer),
    (Critic, CriticTrainer), (Critic, Trainer), (RefModel, LogProbModel), (AdapterOffRef, LogProbModel),
])
def test_each_trainer_has_every_member_of_its_protocol(cls, protocol):
    assert not _missing(cls, protocol), f"{cls.__name__} lacks {protocol.__name__} members {_missing(cls, protocol)}"


def test_the_protocol_lists_what_the_stages_call():
    assert {"update", "preference_update", "save", "load", "save_hf", "compute_log_probs", "gathered_state_dict",
            "iter_weight_buckets", "probes_in_update", "groups_started", "state_lost", "close", "step"} <= _members(ActorTrainer)


def test_a_trainer_missing_a_member_is_caught():
    class Bare:
        step: int

        def update(self, batch): ...

    assert _missing(Bare, ActorTrainer) == sorted(_members(ActorTrainer) - {"update", "step"})


def test_in_process_members_say_there_is_no_rank_group():
    assert PolicyTrainer.groups_started is None and PolicyTrainer.state_lost is False
    assert PipelinePolicyTrainer.probes_in_update is False and GroupTrainer.probes_in_update is False
