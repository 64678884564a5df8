"""The warm rank group (gpu_jobs.train.ranks): 2 gloo ranks under torchrun, started once, serving
several commands; equal to 1 rank in-process; exact save/load across groups; ZeRO-3 really
partitions; a rank that raises or is killed fails the call with that rank's error, and a new
group works after. Built-in tiny model, 2 CPU ranks, ~2-3 min on 2 cores (4 group starts)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from gpu_jobs.train import ActorConfig, TrainInputError
from tests.train.update_gap import REORDER_REL, initial_weights, metric_approx, update_gap

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

CFG = dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, lr=1e-4, eps=1e-6, entropy_coeff=0.01,
           seed=5, kl_loss={"use_kl_loss": True, "kl_loss_coef": 0.1})
# ZeRO-3 over 2 ranks against 1 rank in-process (zero_stage auto: 0): the same 6 Adam steps, sums
# reduced in another order (per-rank micro-batches, reduce-scatter), so float32 rounding only, whose
# size depends on the CPU. Weights are compared by update_gap (the gap as a fraction of the update's
# norm) and metrics by metric_approx, both bounded by REORDER_REL: tests/train/update_gap.py says why.


def _cfg(**kw) -> ActorConfig:
    return ActorConfig(**{**CFG, **kw})


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def model():
    from gpu_jobs.models import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="module")
def batches(helpers):
    return [helpers.make_batch(seed=40 + i, prompts=4, n=2, ref=True) for i in range(3)]


@pytest.fixture(scope="module")
def group(model):
    from gpu_jobs.train.ranks.trainer import GroupTrainer

    g = GroupTrainer(model, _cfg(zero_stage=3), n_ranks=2)
    t0 = time.perf_counter()
    g.start()
    print(f"\ngroup start: {time.perf_counter() - t0:.1f} s (launch + init {g.last_start_seconds:.1f} s)")
    yield g
    g.close()


@pytest.fixture(scope="module")
def trained(group, batches, tmp_path_factory):
    """3 updates on the warm group, with save() after the 2nd: pids, metrics, weights."""
    url = str(tmp_path_factory.mktemp("group") / "after2")
    out = {"pids": [list(group.pids)], "metrics": [], "seconds": []}
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        out["metrics"].append(group.update(batch))
        out["seconds"].append(time.perf_counter() - t0)
        out["pids"].append(list(group.pids))
        if i == 1:
            group.save(url)
            out["saved"] = group.gathered_state_dict()
    out.update(url=url, final=group.gathered_state_dict(), log_probs=group.compute_log_probs(batches[0]))
    return out


def test_zero3_partitions_parameters_across_ranks(group):
    info = group.rank_info()
    assert [r["rank"] for r in info] == [0, 1] and info[0]["pid"] != info[1]["pid"]
    full = info[0]["full_numel"]
    for r in info:
        assert r["zero_stage"] == 3 and r["full_numel"] == full
        # Each parameter is split in 2 (padded to even): half the elements, +1 per odd tensor.
        assert full / 2 <= r["partition_numel"] <= full / 2 + 32, r
        assert full / 2 <= r["optimizer_numel"] <= full / 2 + 32, r  # fp32 master + Adam moments
    print(f"\nper-rank parameter partition: {[r['partition_numel'] for r in info]} of {full}")


def test_group_serves_updates_without_relaunch_and_equals_one_rank(group, trained, model, batches):
    from gpu_jobs.train import PolicyTrainer

    # One launch: the same two rank processes served all three updates.
    assert len(set(map(tuple, trained["pids"]))) == 1 and len(trained["pids"][0]) == 2
    assert group.groups_started == 1 and group.step == 3

    one = PolicyTrainer(model, _cfg())  # 1 rank in-process, zero_stage auto (0 on one rank)
    seconds = []
    for batch, two in zip(batches, trained["metrics"]):
        t0 = time.perf_counter()
        m = one.update(batch)
        seconds.append(time.perf_counter() - t0)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert two[key] == metric_approx(key, m[key], batch), key
    diff = update_gap(trained["final"], one.gathered_state_dict(), initial_weights(model))
    assert diff < REORDER_REL
    # compute_log_probs over the group == in-process on the same weights (sharded rows, gathered back).
    one.load_weights(trained["final"])
    lp_diff = max(abs(a - b).max() for a, b in zip(trained["log_probs"], one.compute_log_probs(batches[0])))
    assert lp_diff < 1e-5
    print(f"\nupdate seconds, 2-rank group: {[round(s, 2) for s in trained['seconds']]}; "
          f"1 rank in-process: {[round(s, 2) for s in seconds]}; ||dw|| {diff:.2e} of the update, "
          f"|dlogp| {lp_diff:.2e}")


def test_bad_batch_fails_in_parent_and_group_stays_up(group, trained, batches):
    pids = list(group.pids)
    with pytest.raises(TrainInputError, match="advantages"):
        group.update(batches[0].drop(["advantages"]))
    assert group.pids == pids and group.step == 3


def test_weight_buckets_stream_whole_layers_stop_early_and_load_weights(group, trained, batches):
    from gpu_jobs.train.weights import layer_key, stream_weights_into_rollout

    half = list(group.iter_weight_buckets(100_000, torch.bfloat16))
    merged = {k: v for b in half for k, v in b}
    assert _equal(merged, {k: v.to(torch.bfloat16) for k, v in trained["final"].items()})
    buckets = list(group.iter_weight_buckets(100_000))  # fp32
    assert len(buckets) > len(half) > 1
    owner = {}
    for i, b in enumerate(buckets):
        for name, _ in b:  # no layer split over two buckets
            assert owner.setdefault(layer_key(name), i) == i, name
    # A consumer that stops early leaves the group in step for the next command.
    for _ in group.iter_weight_buckets(100_000):
        break
    assert _equal(group.gathered_state_dict(), trained["final"])
    assert set(os.listdir(group.group.workdir)) <= {"launcher.log", "owner.lock", "torchelastic"}  # no batch, bucket

    class Partial:
        def __init__(self):
            self.parts = []

        def update_weights_partial(self, d):
            self.parts.append(d)

    class Whole:
        def update_weights(self, d):
            self.d = d

    p, w = Partial(), Whole()
    assert stream_weights_into_rollout(p, group, bucket_bytes=100_000) == len(buckets)
    assert _equal({k: v for d in p.parts for k, v in d.items()}, trained["final"])
    assert stream_weights_into_rollout(w, group) == 1 and _equal(w.d, trained["final"])

    # load_weights: a full state dict, with the tied head under its second name (same storage).
    state = dict(trained["saved"])
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    group.load_weights(state)
    assert _equal(group.gathered_state_dict(), trained["saved"])


def test_save_then_load_in_fresh_group_is_bitwise_and_resumes_exactly(trained, model, batches):
    from gpu_jobs.train.ranks.trainer import GroupTrainer

    fresh = GroupTrainer(model, _cfg(zero_stage=3), n_ranks=2)
    try:
        fresh.load(trained["url"])
        assert fresh.step == 2
        assert _equal(fresh.gathered_state_dict(), trained["saved"])
        metrics = fresh.update(batches[2])  # the 3rd update again, after the load
        assert metrics["actor/pg_loss"] == trained["metrics"][2]["actor/pg_loss"]
        assert _equal(fresh.gathered_state_dict(), trained["final"])
        _killed_rank_then_recover(fresh, trained, batches)
        _raising_rank_then_recover(fresh, trained)
    finally:
        last = fresh.group
        fresh.close()
    assert fresh.group is None and last.alive_pids() == [] and not os.path.exists(last.workdir)


def _killed_rank_then_recover(g, trained, batches):
    """SIGKILL rank 1 between calls: the next call names it; the old processes are all gone; the
    trainer state (updated since its load) is reported lost, and load() starts a new group."""
    from gpu_jobs.train.ranks.errors import RankGroupError, TrainerStateLostError

    old, pids = g.group, list(g.pids)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankGroupError) as err:
        g.compute_log_probs(batches[0])
    e = err.value
    assert e.rank == 1 and e.pid == pids[1] and "rank 1" in str(e) and "SIGKILL" in str(e), str(e)[:2000]
    assert old.alive_pids() == [] and not old.usable
    assert g.state_lost
    with pytest.raises(TrainerStateLostError):
        g.update(batches[0])
    g.load(trained["url"])
    assert set(g.pids).isdisjoint(pids) and g.groups_started == 2
    g.update(batches[2])
    assert _equal(g.gathered_state_dict(), trained["final"])


def _raising_rank_then_recover(g, trained):
    """A Python error on rank 1 reaches the caller with rank 1's traceback; the state was at a
    save point (just loaded), so the next call restores it in a fresh group by itself."""
    from gpu_jobs.train.ranks.errors import RankGroupError

    g.load(trained["url"])  # clean: at the checkpoint
    pids = list(g.pids)
    with pytest.raises(RankGroupError) as err:
        g._debug_raise(1, "boom on rank one")
    e = err.value
    assert e.rank == 1 and "boom on rank one" in e.traceback_text and "Traceback" in e.traceback_text
    assert "rank 1" in str(e).splitlines()[0]
    assert not g.state_lost
    assert _equal(g.gathered_state_dict(), trained["saved"])  # a fresh group, reloaded
    assert set(g.pids).isdisjoint(pids) and g.step == 2


def test_two_nodes_on_one_machine_train_like_one_node_of_two_ranks(trained, model, batches, tmp_path):
    """trainer.nnodes=2 x 1 rank: this process is node 0, node 1 joins with the command an
    operator (or a work pool job) runs there; same 3 updates as the one-node group, same weights.
    Node 1 reads no file of node 0's folder: the batches reach it broadcast from rank 0."""
    import subprocess
    import sys

    from gpu_jobs.train.ranks.dist import child_env
    from gpu_jobs.train.ranks.trainer import GroupTrainer
    from tests.servers import free_port

    port = free_port()
    g = GroupTrainer(model, _cfg(zero_stage=3), n_ranks=2, nnodes=2, master_addr="127.0.0.1", master_port=port)
    join = g.group_layout().join_command(1).split()
    node1 = subprocess.Popen([sys.executable, *join[1:], "--workdir", str(tmp_path / "node1")], env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for batch in batches:
            g.update(batch)
        info = g.rank_info()
        assert [r["rank"] for r in info] == [0, 1] and g.group.local_ranks == [0]
        final = g.gathered_state_dict()
        assert update_gap(final, trained["final"], initial_weights(model)) < REORDER_REL
        # Each node's ranks upload their own shards; the manifest lists them all, so the state
        # loads elsewhere (here: one rank in-process, resharded).
        url = str(tmp_path / "two-nodes-state")
        g.save(url)
    finally:
        g.close()
        try:
            out = node1.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(node1.pid, signal.SIGKILL)
            out = node1.communicate()[0]
    assert node1.returncode == 0, out[-3000:]  # node 1's ranks ended with the group
    assert "node 1 of 2 joining 127.0.0.1" in out
    from gpu_jobs.train import PolicyTrainer

    one = PolicyTrainer(model, _cfg())
    one.load(url)
    assert one.step == 3 and _equal(one.gathered_state_dict(), final)


def test_a_node_that_never_joins_fails_the_start_naming_the_join_command(model):
    from gpu_jobs.train.ranks.errors import RankGroupError
    from gpu_jobs.train.ranks.trainer import GroupTrainer
    from tests.servers import free_port

    port = free_port()
    # The timeout is all this waits for: node 1 never comes, however fast node 0 starts.
    g = GroupTrainer(model, _cfg(zero_stage=3), n_ranks=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
                     start_timeout=6)
    with pytest.raises(RankGroupError) as err:
        g.start()
    head = str(err.value).splitlines()[0]
    assert "2-node group did not form within 6 s" in head, head
    assert f"python -m gpu_jobs.train.ranks.launch --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 " \
           f"--master-port {port}" in head
    assert g.group is not None and g.group.alive_pids() == []


def test_node_layouts_and_the_join_command_refuse_what_cannot_form():
    from gpu_jobs.train.ranks.launch import NodeLayout, main

    assert NodeLayout(4, 2, "10.0.0.5", 29400).torchrun_args(1) == [
        "--nnodes=2", "--node_rank=1", "--nproc_per_node=2", "--master_addr=10.0.0.5", "--master_port=29400"]
    assert NodeLayout(2).torchrun_args(0) == ["--standalone", "--nproc_per_node=2"]
    with pytest.raises(ValueError, match="spread evenly"):
        NodeLayout(3, 2, "h", 1)
    with pytest.raises(ValueError, match="trainer.master_addr and trainer.master_port"):
        NodeLayout(2, 2)
    for argv in (["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-addr", "h",
                  "--master-port", "1"],
                 ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "",
                  "--master-port", "0"]):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2
