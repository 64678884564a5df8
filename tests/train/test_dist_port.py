"""A one-rank process group whose self-chosen port was taken before its store listened picks
another port instead of failing the update (seen as EADDRINUSE in a busy test run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, socket
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    import gpu_jobs.train.ranks.dist as dist
    real, ports = dist.free_port, []
    def free_port():  # the first pick is a port someone took meanwhile
        ports.append(busy if not ports else real())
        return ports[-1]
    dist.free_port = free_port
    dist.init_distributed()
    import torch.distributed as td
    assert td.is_initialized() and os.environ["MASTER_PORT"] != str(busy), (ports, os.environ["MASTER_PORT"])
    print("ok", len(ports))
""")


@pytest.mark.deepspeed
def test_a_taken_self_chosen_port_is_replaced():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu",
                              "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})
    assert out.returncode == 0 and "ok 2" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.deepspeed
def test_a_port_the_user_named_is_never_replaced():
    script = SCRIPT.replace('os.environ.pop(k, None)', 'os.environ.pop(k, None)\nos.environ["MASTER_PORT"] = "0"')
    script = script.replace("dist.init_distributed()", 'os.environ["MASTER_PORT"] = str(busy)\ndist.init_distributed()')
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu",
                              "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})
    assert out.returncode != 0 and "EADDRINUSE" in out.stderr, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.mark.deepspeed
def test_a_world_of_one_inherited_without_its_port_still_starts():
    """A process started from one that ran a trainer inherits RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR
    but not the live MASTER_PORT (callers drop it so it cannot clash): DeepSpeed used to fall back to
    MPI discovery there (`No module named 'mpi4py'`; make e2e's image test, order-dependent)."""
    script = SCRIPT.replace('os.environ.pop(k, None)', 'os.environ.pop(k, None)\n'
                            'os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")')
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu",
                              "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})
    assert out.returncode == 0 and "ok 2" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


RESTARTED = textwrap.dedent("""
    import os
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    import deepspeed, torch
    import torch.distributed as td
    from gpu_jobs.train.ranks.dist import free_port, init_distributed

    def engine():
        init_distributed()
        model = torch.nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}
        return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    config=config)[0]

    engine()
    # What an in-process vLLM engine does on shutdown, then the next one (or accelerate) on start:
    # the group DeepSpeed was set up over is destroyed and another WORLD takes its place.
    td.destroy_process_group()
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    engine()  # DeepSpeed's cached groups pointed at the destroyed one: "Group ... is not registered"
    print("ok")
""")


@pytest.mark.deepspeed
def test_an_engine_after_someone_restarted_the_process_group():
    """Seen in make test when a TRL comparison, an in-process vLLM engine and the stage tests
    shared a worker: DeepSpeed kept its groups from a process group someone had replaced."""
    out = subprocess.run([sys.executable, "-c", RESTARTED], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu",
                              "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
