"""How a rank group's processes are launched: torchrun command lines for one node or several,
their environment, and the command every other node runs to join.

    # node 0 (the process that runs the update stage) starts its ranks through RankGroup; on each
    # other node, once, with the same numbers (e.g. as a work pool job's command):
    python -m gpu_jobs.train.ranks.launch --nnodes 2 --node-rank 1 --nproc-per-node 8 \
        --master-addr 10.0.0.5 --master-port 29400

One node: ``torchrun --standalone`` (a free port of its own). Several nodes: torchrun's static
rendezvous at ``master_addr:master_port`` on node 0, ``--nnodes M --node_rank i`` on each; global
ranks 0..n-1 are node 0's, so rank 0, which talks to the parent over the control channel, always
runs beside it. The other nodes' ranks only take part in collectives: the batch and weight files
the parent writes reach them broadcast from rank 0 (``RLMILL_GROUP_NNODES`` tells the worker).
"""

from __future__ import annotations

import argparse
import os
import sys

_WORKER = "gpu_jobs.train.ranks.worker"
_FORKED = "gpu_jobs.train.ranks.forked"
LAUNCHERS = ("fork", "torchrun")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class NodeLayout:
    """Where the ranks of a group run: `nnodes` nodes of `nproc_per_node` ranks each, node 0
    listening at master_addr:master_port when there is more than one node."""

    def __init__(self, n_ranks: int, nnodes: int = 1, master_addr: str = "", master_port: int = 0):
        if nnodes < 1 or n_ranks < nnodes or n_ranks % nnodes:
            raise ValueError(f"{n_ranks} ranks cannot be spread evenly over {nnodes} nodes: give a rank count "
                             f"that is nnodes x ranks per node")
        if nnodes > 1 and (not master_addr or not master_port):
            raise ValueError(f"a group over {nnodes} nodes needs the address and port node 0 listens on, which "
                             f"the other nodes connect to: set trainer.master_addr and trainer.master_port (or "
                             f"MASTER_ADDR and MASTER_PORT in the environment, e.g. a work pool's job variables)")
        self.n_ranks, self.nnodes = n_ranks, nnodes
        self.nproc_per_node = n_ranks // nnodes
        self.master_addr, self.master_port = master_addr, int(master_port or 0)

    def __repr__(self) -> str:
        where = f" at {self.master_addr}:{self.master_port}" if self.nnodes > 1 else ""
        return f"NodeLayout({self.nnodes} node(s) x {self.nproc_per_node} ranks{where})"

    def torchrun_args(self, node_rank: int) -> list[str]:
        """torchrun's own arguments for node `node_rank`."""
        if self.nnodes == 1:
            return ["--standalone", f"--nproc_per_node={self.nproc_per_node}"]
        return [f"--nnodes={self.nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={self.nproc_per_node}",
                f"--master_addr={self.master_addr}", f"--master_port={self.master_port}"]

    def command(self, python: str, node_rank: int, address: str, workdir: str, launcher: str = "torchrun"
                ) -> list[str]:
        """The launcher command of node `node_rank`; `address` is the parent's control channel
        (used by rank 0 only, so 'none' on the other nodes). `launcher`: see launcher_for."""
        if launcher == "fork":
            if self.nnodes != 1:
                raise ValueError(f"the fork launcher starts one node's ranks; this group has {self.nnodes} nodes")
            return [python, "-m", _FORKED, "--nproc-per-node", str(self.nproc_per_node), "--address", address,
                    "--workdir", workdir]
        return [python, "-m", "torch.distributed.run", *self.torchrun_args(node_rank),
                "--log-dir", os.path.join(workdir, "torchelastic"),  # torchrun's own files: the caller removes them
                "-m", _WORKER, "--address", address, "--workdir", workdir]

    def join_command(self, node_rank: int) -> str:
        """What an operator (or a work pool job) runs on node `node_rank` to join the group."""
        return (f"python -m gpu_jobs.train.ranks.launch --nnodes {self.nnodes} --node-rank {node_rank} "
                f"--nproc-per-node {self.nproc_per_node} --master-addr {self.master_addr} "
                f"--master-port {self.master_port}")


def rank_env(n_local_ranks: int, nnodes: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: this process's (minus a MASTER_PORT another launch left, see
    dist.child_env), the code on PYTHONPATH, quiet libraries, a fair share of the cores, and
    DeepSpeed's CPU accelerator when there is no CUDA."""
    from .dist import child_env

    env = child_env()
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env["RLMILL_GROUP_NNODES"] = str(nnodes)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls c10d collectives torch 2.13 renamed: one warning per call otherwise.
    env.setdefault("PYTHONWARNINGS", "ignore:`torch.distributed.:FutureWarning")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_local_ranks)))
    if "DS_ACCELERATOR" not in env:
        try:
            import torch

            if not torch.cuda.is_available():
                env["DS_ACCELERATOR"] = "cpu"
        except ImportError:
            env["DS_ACCELERATOR"] = "cpu"
    return env


def launcher_for(layout: NodeLayout, env: dict[str, str]) -> str:
    """How node 0 starts its ranks: "fork" (gpu_jobs.train.ranks.forked: one interpreter imports
    torch and DeepSpeed once and forks the ranks) for a one-node group without CUDA, else
    "torchrun". RLMILL_RANK_LAUNCHER=torchrun in `env` asks for torchrun anyway; "fork" cannot be
    forced where it is unsafe (CUDA) or cannot work (several nodes)."""
    asked = env.get("RLMILL_RANK_LAUNCHER", "").strip().lower()
    if asked and asked not in LAUNCHERS:
        raise ValueError(f"RLMILL_RANK_LAUNCHER={asked!r}: use one of {', '.join(LAUNCHERS)} (or leave it unset)")
    if asked == "torchrun" or layout.nnodes != 1 or env.get("DS_ACCELERATOR") != "cpu":
        return "torchrun"
    return "fork"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpu_jobs.train.ranks.launch",
                                description="Join a multi-node rlmill rank group from node 1, 2, ...: start this "
                                            "node's ranks, which wait for node 0 (the update stage's process).")
    p.add_argument("--nnodes", type=int, required=True, help="nodes in the group (trainer.nnodes)")
    p.add_argument("--node-rank", type=int, required=True, help="this node's index, 1 .. nnodes-1")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks on each node (trainer.n_gpus_per_node)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", ""),
                   help="node 0's address (trainer.master_addr; default $MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", "0") or 0),
                   help="node 0's rendezvous port (trainer.master_port; default $MASTER_PORT)")
    p.add_argument("--workdir", default="", help="this node's local folder for the ranks' error files and logs")
    return p


def main(argv: list[str] | None = None) -> int:
    """Join: exec torchrun for this node's ranks (its exit code is this command's)."""
    import tempfile

    p = _parser()
    args = p.parse_args(argv)
    try:
        layout = NodeLayout(args.nnodes * args.nproc_per_node, args.nnodes, args.master_addr, args.master_port)
    except ValueError as exc:
        p.error(str(exc))
    if not 1 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank}: the joining nodes are 1 .. {args.nnodes - 1} (node 0 is the "
                f"update stage's own process, which starts its ranks itself)")
    workdir = args.workdir or tempfile.mkdtemp(prefix=f"rlmill-node{args.node_rank}-")
    os.makedirs(workdir, exist_ok=True)
    cmd = layout.command(sys.executable, args.node_rank, "none", workdir)
    env = rank_env(layout.nproc_per_node, layout.nnodes)
    sys.stdout.write(f"rlmill: node {args.node_rank} of {args.nnodes} joining {layout.master_addr}:"
                     f"{layout.master_port} with {layout.nproc_per_node} rank(s); files in {workdir}\n")
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
