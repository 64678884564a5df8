"""How far apart the trainer's and the rollout engine's log-probs sit, per precision: the
agreement probe's bounds measured (docs/guide/agreement.md).

    python -m benchmarks.bench_agreement                       # SmolLM2 times tables, vLLM
    python -m benchmarks.bench_agreement --config examples/grpo_times_smollm2.yaml --prompts 40
    python -m benchmarks.bench_agreement --set rollout.engine=hf --cases fp32,bf16

Each case is one run config (the `--config` file with `--set` overrides, root in a temporary
folder) with the rollout engine's and the trainer's precision set, loaded in a fresh process
(one vLLM engine per process) the way a run loads it. The run-start probe
(`gpu_jobs.stages.resume.probe_agreement`) then samples 2 responses to each of `--prompts`
held-out prompts and re-scores them with the trainer; nothing is trained. Cases:

- `fp32`, `bf16`: both engines in that precision;
- `rollout-bf16`, `trainer-bf16`: one of the two in bf16, the other fp32 (how far one bf16
  engine sits from fp32 on its own);
- `bf16-temp-1.0`, `bf16-temp+0.05`: both in bf16 with the trainer dividing the logits by a
  temperature other than the rollout's (1.0, rollout's + 0.05): what a real fault looks like
  at this precision, against the noise of the rows above.

Columns: mean and max |p_rollout - p_trainer| over the sampled tokens (verl's
`training/rollout_probs_diff_*`), the mean log-prob gap in nats, the tokens probed, the limit
the config applies by default (`agreement.threshold`) and whether the probe passes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# case -> (rollout.engine_options.dtype, actor.dtype, trainer temperature: None = the rollout's,
# "+x" = the rollout's + x, else that value)
CASES: dict[str, tuple[str, str, str | None]] = {
    "fp32": ("float32", "fp32", None),
    "rollout-bf16": ("bfloat16", "fp32", None),
    "trainer-bf16": ("float32", "bf16", None),
    "bf16": ("bfloat16", "bf16", None),
    "bf16-temp-1.0": ("bfloat16", "bf16", "1.0"),
    "bf16-temp+0.05": ("bfloat16", "bf16", "+0.05"),
}
DEFAULT_CONFIG = "examples/grpo_times_smollm2.yaml"


def trainer_temperature(rollout_temperature: float, spec: str | None) -> float:
    """The temperature a case's trainer divides by: the rollout's, the rollout's + x ("+x"), or a value."""
    if spec is None:
        return rollout_temperature
    return rollout_temperature + float(spec[1:]) if spec.startswith("+") else float(spec)


def case_overrides(case: str, root: str, prompts: int, extra: list[str]) -> list[str]:
    """The run-config overrides of one case: report-only probe, its two precisions, a throwaway root."""
    rollout_dtype, actor_dtype, _ = CASES[case]
    # Enough held-out prompts to probe `prompts` of them; the probe only reports here (the
    # limit a run would apply is computed separately and printed beside it).
    return [f"root={root}", f"rollout.engine_options.dtype={rollout_dtype}", f"actor.dtype={actor_dtype}",
            f"data.val_size={prompts}", "agreement.max_probs_diff_mean=1000000", *extra]


def measure_case(case: str, config: str, prompts: int, extra: list[str]) -> dict:
    """Load the run's roles for one case and probe; in the calling process (one case per process)."""
    import torch

    from flows.config import load_run_config
    from gpu_jobs.stages import Roles, Run
    from gpu_jobs.stages.resume import probe_agreement

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as root:
        cfg = load_run_config(config, case_overrides(case, root, prompts, extra))
        # The limit a run of this case would apply by default: its own, without the report-only one.
        limit = cfg.agreement.model_copy(update={"max_probs_diff_mean": None}).threshold(cfg.rollout, cfg.actor)
        run = Run.open(cfg)
        roles = Roles.load(run)
        roles.trainer.config = roles.trainer.config.model_copy(update={
            "temperature": trainer_temperature(cfg.rollout.temperature, CASES[case][2])})
        metrics = probe_agreement(run, roles, f"bench case {case}", n_prompts=prompts)
        roles.close()
    return {"case": case, "limit": limit, **{k.split("/")[-1]: v for k, v in metrics.items()}}


def run_case(case: str, args: argparse.Namespace) -> dict:
    """One case in a fresh interpreter; its JSON line back."""
    cmd = [sys.executable, "-m", "benchmarks.bench_agreement", "--one", case, "--config", args.config,
           "--prompts", str(args.prompts)] + [x for s in args.set for x in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # its stderr, not a traceback
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"case {case} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    """The printed table, one line per case."""
    out = ["| case | mean abs dp | max abs dp | mean abs dlogp (nats) | tokens | default limit | passes |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        limit = r["limit"]
        passes = "report only" if limit is None else ("yes" if r["rollout_probs_diff_mean"] <= limit else "NO")
        out.append(f"| {r['case']} | {r['rollout_probs_diff_mean']:.2e} | {r['rollout_probs_diff_max']:.3f} | "
                   f"{r['rollout_logprobs_diff_mean']:.2e} | {int(r['agreement_tokens'])} | "
                   f"{'-' if limit is None else f'{limit:g}'} | {passes} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config (default {DEFAULT_CONFIG})")
    p.add_argument("--prompts", type=int, default=40, help="held-out prompts probed, 2 responses each")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_case(args.one, args.config, args.prompts, args.set)))
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.prompts < 1:
        p.error("--prompts must be at least 1")
    if not os.path.exists(args.config):
        p.error(f"--config {args.config}: no such file")
    print(f"{args.config} {' '.join(args.set)}, {args.prompts} held-out prompts x 2 responses per case")
    print(table([run_case(c, args) for c in cases]))


if __name__ == "__main__":
    main()
