"""The one-node CPU launcher: one interpreter imports torch, transformers and DeepSpeed once, then
forks the group's ranks from itself, instead of torchrun starting N fresh interpreters that each
import them again.

    python -m gpu_jobs.train.ranks.forked --nproc-per-node 2 --address 127.0.0.1:4000 --workdir /dev/shm/g

Why: on CPU a rank's imports are most of a group start (torch, transformers and DeepSpeed are
~5 s of CPU per interpreter on 2 cores, and torchrun's own interpreter imports torch too), and a
group starts again after every rank failure and for every remote update. Forked ranks share the
imported modules' pages until they write them.

What the ranks see is what torchrun gives them: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR/MASTER_PORT (a free port of this machine), then
``gpu_jobs.train.ranks.worker.main``. What the parent sees is what torchrun does: one launcher
process whose ranks die with it (PR_SET_PDEATHSIG), that stops the other ranks when one fails and
exits 1, and whose log says ``exitcode: <code> (pid: <pid>)`` for the rank that failed (the
format gpu_jobs.train.ranks.failure.exit_codes reads). SIGTERM to the launcher goes on to the ranks.

Only one node and only without CUDA (launch.launcher_for): a CUDA context must not exist in a
process that forks, DeepSpeed's accelerator probe may create one, and a multi-node group needs
torchrun's rendezvous.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

__all__ = ["main"]

STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL


def _preload() -> None:
    """Import what every rank imports, once, before forking (the ranks inherit the modules)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from gpu_jobs.train import policy  # noqa: F401  (the trainer a rank builds; imports the model code)
    from gpu_jobs.train.ranks import dist, worker  # noqa: F401

    if os.environ.get("DS_ACCELERATOR") == "cpu":
        import deepspeed  # noqa: F401


def _rank(r: int, n: int, port: int, worker_args: list[str]) -> None:
    """In the forked child: torchrun's variables, then the worker; never returns."""
    code = 1
    try:
        from gpu_jobs.train.ranks.processes import set_pdeathsig

        set_pdeathsig()  # before anything else: a rank must not outlive the launcher
        os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                          GROUP_RANK="0", ROLE_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from gpu_jobs.train.ranks import worker

        code = worker.main(worker_args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the worker writes its own error file; this is what escaped it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(children: dict[int, int]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after STOP_GRACE_S; reap them all."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while children and time.monotonic() < end:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid:
                children.pop(pid, None)
            else:
                time.sleep(0.02)
        if not children:
            return


def _say(line: str) -> None:
    sys.stdout.write(f"[rlmill launcher] {line}\n")
    sys.stdout.flush()


def supervise(children: dict[int, int]) -> int:
    """Wait for the ranks (pid -> rank): 0 once all exited 0; at the first that did not, stop the
    rest and return 1, as torchrun does."""
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        rank = children.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N (torchrun's convention too)
        if code != 0:
            _say(f"rank {rank} failed: exitcode: {code} (pid: {pid}); stopping the other ranks")
            _stop(children)
            return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpu_jobs.train.ranks.forked", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks to fork")
    p.add_argument("--address", required=True, help="host:port of the parent's Listener (rank 0 connects)")
    p.add_argument("--workdir", required=True, help="the group's local folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.nproc_per_node < 1:
        _say(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        return 2
    from gpu_jobs.train.ranks.dist import free_port

    _preload()
    port = free_port()  # this node's own, as torchrun --standalone picks one
    worker_args = ["--address", args.address, "--workdir", args.workdir]
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for r in range(args.nproc_per_node):
        pid = os.fork()
        if pid == 0:
            _rank(r, args.nproc_per_node, port, worker_args)
        children[pid] = r
    _say(f"{args.nproc_per_node} rank(s) forked: pids {sorted(children, key=children.get)}")

    def forward(signum, _frame):
        _stop(children)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return supervise(children)


if __name__ == "__main__":
    sys.exit(main())
