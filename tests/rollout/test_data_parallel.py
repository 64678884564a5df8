"""Data-parallel rollout (rollout.engine_options.data_parallel_size): replicas in their own
processes, prompts split evenly, every weight sync reaching every replica.

    .venv/bin/python -m pytest -q tests/rollout/test_data_parallel.py
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_jobs.rollout import HFRolloutEngine, RolloutEngineConfig, SamplingConfig, get_rollout_engine
from gpu_jobs.rollout.base import check_parallelism
from gpu_jobs.rollout.data_parallel import (
    SEED_STRIDE,
    DataParallelRollout,
    build_rollout_engine,
    RolloutReplicaError,
    replica_env,
    split_evenly,
)

SAMPLE = SamplingConfig(temperature=1.0, max_response_length=6, seed=3)


def test_split_evenly_covers_every_item_once_with_sizes_within_one():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]
    for total in range(0, 12):
        for parts in range(1, 5):
            bounds = split_evenly(total, parts)
            assert [i for a, b in bounds for i in range(a, b)] == list(range(total))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_replica_env_gives_each_replica_its_own_devices():
    assert replica_env(1, 2, 4, 3, cuda=True)["CUDA_VISIBLE_DEVICES"] == "2,3"
    cpu = replica_env(0, 1, 2, 1, cuda=False)
    assert "CUDA_VISIBLE_DEVICES" not in cpu and cpu["OMP_NUM_THREADS"] == "1"


def test_seed_stride_is_the_vllm_engines():
    from gpu_jobs.rollout import vllm_engine

    assert SEED_STRIDE == vllm_engine._SEED_STRIDE  # else vLLM replicas would not draw one engine's samples


def test_tensor_parallelism_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="needs rollout.engine=vllm"):
        check_parallelism("hf", RolloutEngineConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        check_parallelism("vllm", RolloutEngineConfig(tensor_parallel_size=2), cuda=False)
    check_parallelism("vllm", RolloutEngineConfig(tensor_parallel_size=2), cuda=True)
    with pytest.raises(ValueError):
        RolloutEngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="build them with gpu_jobs.rollout.data_parallel.build_rollout_engine"):
        get_rollout_engine("hf", "builtin", RolloutEngineConfig(data_parallel_size=2))  # never one engine in silence


@pytest.fixture(scope="module")
def replicas(builtin_path):
    engine = build_rollout_engine("hf", builtin_path, RolloutEngineConfig(data_parallel_size=2))
    yield engine
    engine.close()


def test_prompts_are_split_and_rows_keep_the_calls_prompt_indices(replicas, builtin_path, prompts):
    assert isinstance(replicas, DataParallelRollout) and len(set(replicas.pids)) == 2
    assert os.getpid() not in replicas.pids
    rows = replicas.generate(prompts, n=2, sampling=SAMPLE)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, s) for i in range(len(prompts))
                                                                      for s in range(2)]
    assert all(r["prompt_ids"] == prompts[r["prompt_index"]] for r in rows)
    # Replica j drew its shard with seed + start_j * SEED_STRIDE: one local engine does the same.
    single = HFRolloutEngine(builtin_path)
    (a, b), (c, d) = split_evenly(len(prompts), 2)
    first = single.generate(prompts[a:b], 2, SAMPLE)
    second = single.generate(prompts[c:d], 2, SAMPLE.model_copy(update={"seed": SAMPLE.seed + c * SEED_STRIDE}))
    assert [r["response_ids"] for r in rows] == [r["response_ids"] for r in first + second]
    assert replicas.generate(prompts, n=2, sampling=SAMPLE) == rows  # seeded: the same again


def _scores_match(engine, reference, sequences):
    got = engine.score_tokens(sequences)
    want = reference.score_tokens(sequences)
    return max(abs(x - y) for g, w in zip(got, want) for x, y in zip(g, w))


def test_every_weight_sync_reaches_every_replica(replicas, builtin, builtin_path, prompts, tmp_path):
    model, _ = builtin
    torch.manual_seed(0)
    changed = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    reference = HFRolloutEngine(builtin_path)
    reference.update_weights(changed)
    # Both replicas score a share of these: a stale replica would be off by far more than 1e-4.
    sequences = [p + [5, 6, 7] for p in prompts]
    assert _scores_match(replicas, reference, sequences) > 1e-2  # the change is visible
    replicas.update_weights(changed)  # in memory, in buckets
    assert _scores_match(replicas, reference, sequences) < 1e-4
    # From a folder, as a resumed run or a remote rollout loads published weights.
    reference.update_weights(builtin_path)
    replicas.update_weights(builtin_path)
    assert _scores_match(replicas, reference, sequences) < 1e-4


def test_a_replica_that_fails_names_itself_and_the_others_keep_serving(replicas, prompts):
    with pytest.raises(RolloutReplicaError, match=r"rollout replica \d of 2 \(pid \d+\) failed in generate"):
        replicas.generate([prompts[0], []], n=1, sampling=SAMPLE)  # replica 1 gets the empty prompt
    assert len(replicas.generate(prompts[:3], n=1, sampling=SAMPLE)) == 3


def test_a_replica_that_dies_fails_the_call_and_close_leaves_nothing_running(builtin_path, prompts):
    engine = DataParallelRollout("hf", builtin_path, RolloutEngineConfig(data_parallel_size=2), 2)
    pids = list(engine.pids)
    try:
        os.kill(engine.pids[1], 9)
        with pytest.raises(RolloutReplicaError, match=r"replica 1 of 2 .* died during generate \(exit code -9\)"):
            engine.generate(prompts, n=1, sampling=SAMPLE)
    finally:
        engine.close()
    assert engine.alive_pids() == []
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]  # reaped, not even zombies
