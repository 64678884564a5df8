"""`make bench-e2e`'s pure parts (configs, token counts, clocks, table), the shared evaluation, the
prompts TRL gets (arith and SmolLM2's times task), the reward on both sides, the per-run memory
measure, and one tiny real TRL run when TRL is installed.

    .venv/bin/python -m pytest -q tests/bench/test_bench_e2e.py
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from benchmarks import bench_e2e as be
from gpu_jobs.models.loading import smollm2_available

torch.set_num_threads(1)  # 2 cores shared with other jobs


@pytest.fixture(scope="module")
def builtin():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_jobs.models import ensure_builtin_model

    path = ensure_builtin_model()
    return path, AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_both_sides_get_the_same_batch_sizes_lr_and_loss(tmp_path):
    w = be.Workload(prompts=32, lr=3e-5, mini_batches=4)
    cfg = be.rlmill_config(w, str(tmp_path), "r", iterations=5, checkpoint_every=5)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.rollout.max_response_length) == (32, 8, 6)
    assert cfg.actor.ppo_mini_batch_size == 8 and cfg.actor.ppo_epochs == 1 and cfg.actor.lr == 3e-5
    assert not cfg.needs_ref and cfg.actor.policy_loss.loss_agg_mode == "token-mean"
    args = be.trl_args(w, cfg, max_steps=5, output_dir=str(tmp_path))
    # TRL counts completions: one optimizer step = 8 prompts x 8 samples = rlmill's mini-batch;
    # one generation batch = 4 such steps = rlmill's iteration.
    assert args["per_device_train_batch_size"] == 64 and args["steps_per_generation"] == 4
    assert args["gradient_accumulation_steps"] == 1 and args["max_steps"] == 20
    assert (args["learning_rate"], args["weight_decay"], args["max_grad_norm"]) == (3e-5, 0.01, 1.0)
    assert (args["beta"], args["loss_type"], args["num_generations"], args["max_completion_length"]) == (0.0, "bnpo", 8, 6)
    assert args["use_cpu"] and not args["bf16"] and args["save_strategy"] == "no" and not args["shuffle_dataset"]
    with pytest.raises(ValueError, match="multiple of --mini-batches"):
        be.Workload(prompts=30, mini_batches=4)


def test_token_counts_and_step_summary():
    # 3 responses of 2, 3, 1 tokens after prompts of 6 tokens: 6 generated, 18 + 6 trained.
    assert be.token_counts([6, 6, 6], [2, 3, 1]) == (6, 24)
    s = be.summarize([9.0, 2.0, 4.0, 3.0], [100, 60, 60, 60], [300, 200, 200, 200])
    # The first step is warm-up: median of 2, 4, 3 is 3 s; 60 tokens per step / 3 s.
    assert s == {"s_step": 3.0, "gen_tps": 20.0, "train_tps": 200 / 3}


def test_first_crossing_starts_the_clock_after_the_first_step():
    assert be.first_crossing([10.0, 2.0, 2.0, 2.0], 3.0) == (3, 4.0)
    assert be.first_crossing([10.0, 2.0, 2.0], 4.0) == (3, 4.0)  # reaching the budget exactly stops
    assert be.first_crossing([1.0, 1.0], 60.0) == (2, 1.0)  # never crossed: the last step
    assert be.budget_steps(60.0, 2.0, 1.3) == 41


def test_table_ratios_are_row_over_trl_and_missing_values_show_as_dashes():
    gib = 2**30
    results = {"rlmill-flow": {"s_step": 1.0, "gen_tps": 300.0, "train_tps": 900.0, "acc_after": 0.5,
                               "steps": 30, "train_seconds": 60.5, "rss_peak": 3 * gib, "rss_tree": 3.5 * gib},
               "rlmill-vllm": {},
               "trl": {"s_step": 2.0, "gen_tps": 100.0, "train_tps": 600.0, "acc_after": 0.4,
                       "steps": 15, "train_seconds": 61.0, "rss_peak": 6 * gib, "rss_tree": 6 * gib}}
    lines = be.format_table(results, 0.4)
    flow = lines[2].split()
    assert flow[0] == "rlmill-flow" and flow[-5:] == ["0.50x", "3.00x", "1.50x", "0.50x", "1.25x"]
    assert flow[4:6] == ["3.00", "3.50"]  # peak GB, tree GB
    assert "50.0 %" in lines[2] and "40.0 %" in lines[2]
    assert lines[0].index("|") == lines[1].index("|") == lines[2].index("|")  # the ratio columns line up
    assert lines[3].split()[0] == "rlmill-vllm" and lines[3].count("-") >= 12
    assert lines[4].split()[-5:] == ["1.00x"] * 5
    goals = be.goal_lines(results, {"rlmill-flow": 1.5, "rlmill-stages": 1.0})
    assert goals == ["  rlmill-flow: train tok/s 1.50x trl (goal >= 1.5x: met); acc after 50.0 % vs trl 40.0 % (met)"]
    # Without a `trl` row, the TRL row that ran is the reference of the ratios and of the accuracy.
    only_vllm = {"rlmill-vllm": results["rlmill-flow"], "trl-vllm": results["trl"]}
    lines = be.format_table(only_vllm, 0.4)
    assert lines[0].endswith("|  rlmill / trl-vllm") and lines[2].split()[-5:] == ["0.50x", "3.00x", "1.50x", "0.50x", "1.25x"]
    assert be.goal_lines(only_vllm, {})[0].endswith("acc after 50.0 % vs trl-vllm 40.0 % (met)")


def test_shared_evaluation_agrees_with_rlmill_engine_and_can_fail(builtin, tmp_path):
    from gpu_jobs.models import greedy_exact_match

    _, model, tok = builtin
    _, test = be.task_splits(be.rlmill_config(be.Workload()), str(tmp_path / "data"))
    problems = be.heldout_problems(test, tok, 24)
    assert problems[0][0] == test["prompt"][0][0]["content"]  # "a+b=": the template adds nothing
    score = be.task_score("arith")
    acc = be.greedy_accuracy(model, tok, problems, 6, score, batch_size=10)
    # Plain `generate` and rlmill's own decode loop: two implementations, one greedy answer.
    assert acc == greedy_exact_match(model, tok, problems)
    assert 0.0 < acc < 1.0
    assert be.greedy_accuracy(model, tok, [(p, "x" + t) for p, t in problems], 6, score) == 0.0


@pytest.mark.e2e  # ~30 s of vLLM starts; make test is near its 12 minutes
def test_shared_evaluation_on_vllm_gives_transformers_scores_per_folder(builtin, tmp_path):
    pytest.importorskip("vllm")
    from benchmarks.heldout_eval import evaluate_folders

    path, model, tok = builtin
    _, test = be.task_splits(be.rlmill_config(be.Workload()), str(tmp_path / "data"))
    problems = be.heldout_problems(test, tok, 24)
    acc = be.greedy_accuracy(model, tok, problems, 6, be.task_score("arith"))
    assert 0.0 < acc < 1.0  # a score that could differ (the transformers side's test shows it can fail)
    # A policy saved mid-run may be weights and config only (TRL's model.save_pretrained): the shared
    # tokenizer serves it. One interpreter, one engine per folder: the second starts clean.
    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(path, name), bare / name)
    assert evaluate_folders({"a": path, "b": str(bare)}, problems, 6, "arith", path, threads=1) == {"a": acc, "b": acc}
    with pytest.raises(RuntimeError, match="held-out evaluation failed"):
        evaluate_folders({"a": str(tmp_path / "no-such-folder")}, problems, 6, "arith", path, threads=1)


def test_trl_gets_exactly_the_prompts_of_rlmill_iterations(builtin, tmp_path):
    from gpu_jobs.stages import Run
    from gpu_jobs.data import render_prompt

    _, _, tok = builtin
    w = be.Workload(prompts=4)
    cfg = be.rlmill_config(w, str(tmp_path / "run"), "r")
    train, _ = be.task_splits(cfg, str(tmp_path / "data"))
    rows = be.trl_rows(cfg, train, tok, steps=3)
    run = Run.open(cfg)  # what the rollout stage samples from, after the prompt gate
    expected = [run.train.iloc[i] for k in range(3) for i in run.sampler.indices(k)]
    assert rows["ground_truth"] == [r["reward_model"]["ground_truth"] for r in expected]
    # TRL tokenizes a plain-string prompt with processing_class(text=...): same ids as rlmill's.
    assert [tok(text=p)["input_ids"] for p in rows["prompt"]] == [render_prompt(r["prompt"], tok) for r in expected]
    assert len(set(rows["prompt"])) == 12


@pytest.mark.slow
def test_trl_smoke_counts_tokens_and_stops_on_the_clock(builtin, tmp_path):
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM

    path, start, tok = builtin
    w = be.Workload(prompts=2)
    spec = {"row": "trl", "workload": be.asdict(w), "model_path": path, "data_dir": str(tmp_path / "data"),
            "root": str(tmp_path / "trl"), "steps": 6, "budget": 1e-3, "heldout": 8, "eval_every": 1}
    out = be.run_trl(spec)
    # A budget of ~0 stops after step 2 (the clock starts after step 1), not at the cap of 6.
    assert out["steps"] == 2 and len(out["step_seconds"]) == 2 and out["train_seconds"] > 0
    assert len(out["gen_tokens"]) == 2 and all(16 <= g <= 16 * 6 for g in out["gen_tokens"])
    # Prompts are 6 characters: 16 completions add 96 prompt tokens; TRL's own count agrees.
    assert [t - g for t, g in zip(out["train_tokens"], out["gen_tokens"])] == [96, 96]
    assert sum(out["train_tokens"]) == out["num_input_tokens_seen"]
    # The trained weights are saved for the shared evaluation, and they moved.
    trained = AutoModelForCausalLM.from_pretrained(out["weights"]).state_dict()
    assert any(not torch.equal(v, start.state_dict()[k]) for k, v in trained.items())
    # --eval-every 1: step 1's weights were saved for the per-step curve (step 2's are the final ones).
    assert list(out["curve_weights"]) == [1]
    first = AutoModelForCausalLM.from_pretrained(out["curve_weights"][1]).state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in first.items())
    problems = be.heldout_problems(be.task_splits(be.rlmill_config(w), spec["data_dir"])[1], tok, 8)
    assert be.evaluate_folder(out["weights"], tok, problems, 6, be.task_score("arith")) in {i / 8 for i in range(9)}


@pytest.mark.slow
def test_on_the_same_rollout_both_sides_take_the_same_step(builtin, tmp_path, monkeypatch):
    """The bench's two configs (rlmill_overrides, trl_args) give one step, end to end: rlmill's
    iteration 1 (rollout, reward, gate, advantage, DeepSpeed update) and TRL's GRPOTrainer fed that
    iteration's committed responses leave the same weights. tests/algos/test_trl_parity.py pins
    the loss and gradient on a hand-made batch; this pins what the comparison actually runs, so a
    gap in learning per step comes from the samples, not from the step."""
    pytest.importorskip("trl")
    from safetensors.torch import load_file
    from trl.trainer.grpo_trainer import GRPOTrainer

    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from storage import committed, read_table

    path, start, _ = builtin
    w = be.Workload(prompts=4)
    cfg = be.rlmill_config(w, str(tmp_path / "run"), "r")
    run, roles = open_warm(cfg)
    run_iteration(DirectCalls(run, roles), cfg, 1)
    roles.trainer.save_hf(str(tmp_path / "rlmill-1"))
    rollout = read_table(committed(run.layout.stage(1, "rollout"), run.layout.storage)).to_pydict()

    def committed_responses(self, prompt_ids, *_, **__):  # in place of TRL's generation
        assert [list(p) for p in prompt_ids] == rollout["prompt_ids"], "TRL's batch is not rlmill's prompts in order"
        return [list(r) for r in rollout["response_ids"]], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", committed_responses)
    spec = {"row": "trl", "workload": be.asdict(w), "model_path": path, "data_dir": str(tmp_path / "data"),
            "root": str(tmp_path / "trl"), "steps": 1, "budget": 1e9, "heldout": 8}
    out = be.run_trl(spec)

    def weights(folder):
        return {k: v for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(folder, f)).items()}

    ours, theirs, before = weights(str(tmp_path / "rlmill-1")), weights(out["weights"]), start.state_dict()
    assert ours.keys() == theirs.keys()
    moved = torch.cat([(ours[k] - before[k]).abs().flatten() for k in ours])
    apart = torch.cat([(ours[k] - theirs[k]).abs().flatten() for k in ours])
    # Adam's first step moves nearly every weight by ~lr (a different batch: ~lr apart). Where a
    # gradient is near zero, the small differences of the old log-probs' source (rlmill's sampler,
    # TRL's detached current) can tip its sign, so a few weights differ by up to 2 lr. How many
    # depends on the CPU that built the model and runs the step: measured on the built-in model,
    # mean 2.3e-4 lr apart and 1.4e-5 of its 505k weights over 0.5 lr on one machine, 1.1e-3 lr and
    # 3.3e-4 on another (AMX); on SmolLM2-135M at most 0.19 lr. The bounds sit 100x under what a
    # different step gives (~1 lr apart, every weight), not at one machine's rounding.
    assert moved.mean() > 0.5 * w.lr
    assert apart.mean() < 1e-2 * w.lr, f"mean |rlmill - TRL| = {apart.mean():.3g} after one step of lr {w.lr:g}"
    assert (apart > 0.5 * w.lr).float().mean() < 1e-2


# ------------------------------------------------------------------------------ times on SmolLM2 (issue 24)
def test_times_workload_takes_the_example_batch_the_token_cap_and_a_fixed_held_out_count():
    args = be.parse_args(["--workload", "times", "--model", "smollm2", "--tokens", "48"])
    w = be.case_workload("times", "smollm2", args)
    assert (w.task, w.prompts, w.group, w.max_len, w.lr, w.temperature) == ("times", 8, 4, 48, 1e-5, 0.8)
    assert w.val_size == 40 and not w.ignore_eos  # the example's held-out count, for every run of the case
    assert w.example.name == "grpo_times_smollm2.yaml"
    assert be.case_workload("times", "smollm2", be.parse_args(["--workload", "times"])).max_len == 64
    assert be.case_workload("arith", "builtin", be.parse_args([])).val_size is None  # arith: as before


def test_smollm2_and_times_pair_with_each_other_when_the_other_flag_is_left_out():
    from benchmarks.bench_e2e_long import DEFAULT_CASES, pick_cases

    assert pick_cases(None, "smollm2") == pick_cases("times", None) == [("times", "smollm2")]
    assert pick_cases(None, None) == list(DEFAULT_CASES)
    assert pick_cases("arith,times", None) == [("arith", "builtin"), ("times", "smollm2")]
    assert pick_cases(None, "16m") == [("arith", "16m"), ("long128", "16m"), ("long512", "16m")]
    assert pick_cases("long128", "builtin,smollm2") == [("long128", "builtin"), ("long128", "smollm2")]


@pytest.mark.parametrize("argv, message", [
    (["--workload", "times", "--heldout", "61"], "times task holds out at most 60 prompts"),
    (["--workload", "times25", "--heldout", "289"], "times25 task holds out at most 288 prompts"),
    (["--seeds", "0,x"], "give comma-separated integers"),
    (["--seeds", "1,1"], "give distinct seeds"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--workload", "times", "--tokens", "0"], "--tokens must be >= 1"),
    (["--model", "gpt5"], "unknown --model"),
])
def test_bad_flags_end_in_one_line_naming_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        be.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_both_sides_score_times_answers_on_the_last_number():
    from gpu_jobs.reward import default_compute_score

    class Tok:  # counts prompt tokens as TRL's processing_class(text=...) would: one per word here
        def __call__(self, text):
            return {"input_ids": [p.split() for p in text]}

    gen, trained = [], []
    reward = be.trl_reward(be.task_score("times"), Tok(), gen, trained)
    completions = ["7 x 8 = 56", "It is 54.", "56", "Fifty-six", "56.0"]
    truths = ["56"] * len(completions)
    scores = reward(prompts=["What is 7 times 8?"] * 5, completions=completions,
                    completion_ids=[[1] * (i + 1) for i in range(5)], ground_truth=truths)
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    # rlmill scores its rollouts by data_source: the same rule, the same scores.
    assert scores == [default_compute_score("rlmill/times", c, t) for c, t in zip(completions, truths)]
    assert (gen, trained) == ([15], [15 + 5 * 5])  # 1+2+3+4+5 generated; 5-word prompts
    assert reward.__name__ == "last_number_score_reward"


@pytest.mark.skipif(not smollm2_available(), reason="SmolLM2 is not converted here (make smollm2)")
def test_trl_gets_the_times_prompts_of_rlmill_iterations_in_smollm2s_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from gpu_jobs.data import render_prompt
    from gpu_jobs.stages import Run

    w = be.case_workload("times", "smollm2", be.parse_args(["--workload", "times"]))
    cfg = be.rlmill_config(w, str(tmp_path / "run"), "r")
    assert (cfg.data.generate, cfg.data.val_size, cfg.rollout.n, cfg.rollout.max_response_length) == ("times", 40, 4, 64)
    assert (cfg.rollout.temperature, cfg.actor.lr, cfg.data.train_batch_size) == (0.8, 1e-5, 8)
    tok = AutoTokenizer.from_pretrained(be.model_folder("smollm2"))
    train, test = be.task_splits(cfg, str(tmp_path / "data"))
    rows = be.trl_rows(cfg, train, tok, steps=3)
    run = Run.open(cfg)  # what the flow samples and validates on
    expected = [run.train.iloc[i] for k in range(3) for i in run.sampler.indices(k)]
    assert rows["ground_truth"] == [r["reward_model"]["ground_truth"] for r in expected]
    assert [tok(text=p)["input_ids"] for p in rows["prompt"]] == [render_prompt(r["prompt"], tok) for r in expected]
    assert rows["prompt"][0].startswith("<|im_start|>system") and rows["prompt"][0].endswith("<|im_start|>assistant\n")
    # The held-out prompts are the run's validation rows; none of their facts is trained on, in either order.
    problems = be.heldout_problems(test, tok, 40)
    assert [t for _, t in problems] == [r["reward_model"]["ground_truth"] for r in run.val.to_dict("records")]
    held = {frozenset((x["a"], x["b"])) for x in test["extra_info"]}
    assert len(test) == 40 and not held & {frozenset((x["a"], x["b"])) for x in train["extra_info"]}


def test_run_measured_reports_the_exit_code_and_the_largest_process_of_the_tree(tmp_path):
    # The child touches 64 MiB; the grandchild it waits for touches 256 MiB: the kernel's maxrss of
    # the child covers it (the largest process of the tree), and the exit code comes through.
    grandchild = "b = b'x' * (256 << 20)"
    child = ("import subprocess, sys; a = b'x' * (64 << 20); "
             f"subprocess.run([sys.executable, '-c', {grandchild!r}], check=True); sys.exit(3)")
    with open(tmp_path / "log", "w") as log:
        rc, memory = be.run_measured([sys.executable, "-c", child], cwd=tmp_path, stdout=log)
    assert rc == 3
    assert 256 << 20 <= memory["rss_peak"] < 2 << 30 and memory["rss_tree"] >= memory["rss_peak"]
    assert be.median_summary([{"step_seconds": [1.0, 1.0], "gen_tokens": [1, 1], "train_tokens": [2, 2],
                               "rss_peak": 5, "rss_tree": 9},
                              {"step_seconds": [1.0, 1.0], "gen_tokens": [1, 1], "train_tokens": [2, 2],
                               "rss_peak": 7, "rss_tree": 8}])["rss_peak"] == 7  # the highest run


def test_tree_rss_counts_this_process_and_nothing_once_a_process_is_gone():
    from benchmarks.bench_e2e_report import tree_rss

    assert tree_rss(os.getpid()) > 50 << 20  # torch is loaded here
    assert tree_rss(2**22 + 1) == 0  # above Linux's largest possible pid (PID_MAX_LIMIT): never a process


# ------------------------------------------------------------------------------ issue 45: times25 over seeds
def test_times25_pairs_with_smollm2_and_holds_out_200_facts_by_default():
    from benchmarks.bench_e2e_long import pick_cases

    assert pick_cases("times25", None) == [("times25", "smollm2")]
    assert all(w not in ("times", "times25") for w, _ in pick_cases(None, "16m"))
    w = be.case_workload("times25", "smollm2", be.parse_args(["--workload", "times25", "--seeds", "3,4"]))
    assert (w.task, w.val_size, w.prompts, w.group, w.max_len) == ("times25", 200, 8, 4, 64)


@pytest.mark.skipif(not smollm2_available(), reason="SmolLM2 is not converted here (make smollm2)")
def test_a_seed_reaches_rlmills_data_and_sampling_and_trls_seed(tmp_path):
    w = be.replace(be.case_workload("times25", "smollm2", be.parse_args(["--workload", "times25"])), seed=3)
    cfg = be.rlmill_config(w, str(tmp_path / "run"), "r")
    assert (cfg.data.generate, cfg.data.val_size, cfg.data.seed) == ("times25", 200, 3)
    # fp32 on both engines as on TRL's side, whatever the example's `auto` picks on this machine;
    # the bf16 row sets its precision after those.
    assert (cfg.actor.dtype, cfg.rollout.engine_options.dtype) == ("fp32", "float32")
    assert not cfg.algorithm.filter_groups.enable  # TRL's GRPO: one batch per step (the example refills)
    from flows.config import load_run_config

    bf16 = load_run_config(w.example, be.rlmill_overrides(w, str(tmp_path / "bf16"), "r", iterations=2,
                                                          checkpoint_every=2, engine=be.ROW_ENGINES["rlmill-vllm-bf16"])
                           + be.ROW_OVERRIDES["rlmill-vllm-bf16"])
    assert (bf16.actor.dtype, bf16.rollout.engine_options.dtype, bf16.rollout.engine) == ("bf16", "bfloat16", "vllm")
    assert bf16.actor.resolved_zero_stage(1) == 0  # autocast over an fp32 engine: the probe runs in the update
    dapo = load_run_config(w.example, be.rlmill_overrides(w, str(tmp_path / "dapo"), "r", iterations=2,
                                                          checkpoint_every=2, engine=be.ROW_ENGINES["rlmill-vllm-dapo"])
                           + be.ROW_OVERRIDES["rlmill-vllm-dapo"])
    fg = dapo.algorithm.filter_groups
    assert (fg.enable, fg.metric, dapo.rollout.engine, dapo.actor.dtype) == (True, "score", "vllm", "fp32")
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 8  # the example's (4 micro-batches; measured best)
    assert be.trl_args(w, cfg, max_steps=2, output_dir=str(tmp_path), seed=w.seed)["seed"] == 3
    train, test = be.task_splits(cfg, str(tmp_path / "data"))
    held = {frozenset((x["a"], x["b"])) for x in test["extra_info"]}
    # whole facts in both orders: a square is one prompt, so the split can hold one more than asked
    assert len(test) in (200, 201) and not held & {frozenset((x["a"], x["b"])) for x in train["extra_info"]}


def test_iteration_seconds_time_the_last_iteration_by_its_own_span():
    # Subflows start at 0, 22, 45 and end 1 s before the next starts; the last ends at 65.
    spans = [(0.0, 21.0), (22.0, 44.0), (45.0, 65.0)]
    assert be.iteration_seconds(spans) == [22.0, 23.0, 21.0]  # 20 s of span + the 1 s exit gap
    assert be.iteration_seconds([(3.0, 10.0)]) == [7.0] and be.iteration_seconds([]) == []


def test_equal_time_at_every_budget_scores_each_run_after_its_crossing_step():
    from benchmarks.bench_e2e_report import budget_lines, budget_scores

    # Step 1 is off the clock; a fast run crosses 10 s at step 3, a slow one at step 2.
    fast = {"step_seconds": [9.0, 5.0, 5.0, 5.0, 5.0], "curve": {"1": 0.1, "2": 0.2, "3": 0.3, "4": 0.4, "5": 0.5}}
    slow = {"step_seconds": [9.0, 12.0, 12.0], "curve": {1: 0.1, 2: 0.35, 3: 0.45}}
    assert budget_scores(fast["step_seconds"], fast["curve"], [5, 10, 20, 30]) == {5: 0.2, 10: 0.3, 20: 0.5, 30: None}
    assert budget_scores(slow["step_seconds"], {1: 0.1, 3: 0.45}, [5, 24]) == {5: None, 24: 0.45}  # step 2 unscored
    other = {"step_seconds": [9.0, 5.0, 5.0], "curve": {1: 0.1, 2: 0.4, 3: 0.45}}
    lines = budget_lines({0: {"rlmill-vllm": fast, "trl-vllm": slow}, 1: {"trl-vllm": slow, "rlmill-vllm": other}},
                         [5, 10, 20])
    assert lines[1].split() == ["budget", "s", "rlmill-vllm", "trl-vllm", "rlmill-vllm", "-", "trl-vllm", "leads"]
    # 5 s: rlmill 20 and 40 (mean 30) against TRL's 35 twice: -5.0, ahead on seed 1 only.
    assert lines[2].split() == ["5", "30.0", "35.0", "-5.0", "1", "of", "2"]
    assert lines[3].split() == ["10", "37.5", "35.0", "+2.5", "1", "of", "2"]
    assert lines[4].split() == ["20", "-", "45.0", "-"]  # seed 1's rlmill run ended at 10 s
    assert len(budget_lines({0: {"rlmill-vllm": fast}}, [5])[1].split()) == 3  # no TRL row: no differences


def test_seed_summary_means_spreads_and_curves():
    from benchmarks.bench_e2e_report import curve_steps, seeds_lines

    assert curve_steps(10, 4) == [4, 8] and curve_steps(8, 4) == [4] and curve_steps(5, 0) == []
    run = lambda acc, steps, curve: {"acc_after": acc, "steps": steps, "train_seconds": 60.0, "curve": curve}
    by_seed = {0: {"rlmill-vllm": run(0.5, 8, {"4": 0.4, "8": 0.5}), "trl": run(0.3, 4, {4: 0.3})},
               1: {"rlmill-vllm": run(0.7, 9, {4: 0.6, 8: 0.7, 9: 0.7}), "trl": {}}}
    lines = seeds_lines(by_seed, {0: 0.25, 1: 0.35})
    assert lines[0] == "over seeds 0, 1: held-out score before  30.0 ±  7.1 %"
    vllm = lines[2]
    assert vllm.split()[:4] == ["rlmill-vllm", "60.0", "±", "14.1"] and "50.0.. 70.0" in vllm
    assert "4: 50.0  8: 60.0  9: 70.0 (1)" in vllm  # JSON's string keys too; step 9: one seed only
    assert lines[3].split() == ["seed", "0", "50.0", "%", "8", "60.0", "4:", "40.0", "8:", "50.0"]
    assert lines[4].split()[:3] == ["seed", "1", "70.0"] and lines[4].endswith("4: 60.0  8: 70.0  9: 70.0")
    assert lines[5].split()[:2] == ["trl", "30.0"] and "4: 30.0" in lines[5]
    assert lines[6].split()[:3] == ["seed", "0", "30.0"] and len(lines) == 8  # seed 1 ran no TRL row
