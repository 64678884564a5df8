"""Supervised fine-tuning runs (the `sft:` section) through the stage layer: the loss, the
section's refusals and bad files in one line, a demonstration laid out in tokens as the rollout
lays it out (single and multi-turn), a run on the built-in model whose held-out exact match rises,
whose exact match is what greedy decoding reproduces, resumed bitwise from a checkpoint and from
no checkpoint, then an RL run chained on its checkpoint with the source in run.json.

    .venv/bin/python -m pytest -q tests/flows/test_sft_run.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from tests.tiny import REPO

SFT_EXAMPLE, GRPO_EXAMPLE = REPO / "examples" / "sft_arith.yaml", REPO / "examples" / "grpo_arith.yaml"
SMALL = ["sft.train_size=512", "sft.val_size=64", "trainer.tensorboard=false"]


def _config(root: Path, *extra: str, example: Path = SFT_EXAMPLE):
    from flows.config import load_run_config

    return load_run_config(str(example), [f"root={root}", *SMALL, *extra])


# ------------------------------------------------------------------------------ the loss
def test_the_loss_is_the_token_mean_nll_of_the_loss_tokens():
    import torch

    from gpu_jobs.algos.sft import greedy_exact, sft_loss

    # Two rows: log-probs -1, -3 (masked in) and -100 (padding); -2 alone. Mean over the three
    # loss tokens: (1 + 3 + 2) / 3 = 2, the padding's -100 counts for nothing.
    log_prob = torch.tensor([[-1.0, -3.0, -100.0], [-2.0, -100.0, -100.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sft_loss(log_prob, mask)
    assert loss.item() == pytest.approx(2.0) and metrics["train/loss"].item() == pytest.approx(2.0)
    loss.backward()  # d loss / d log_prob = -1/3 on each loss token, 0 on padding
    assert torch.allclose(log_prob.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]]))
    # Exact only where every loss token is the argmax; a miss under the mask does not count.
    match = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert greedy_exact(match, mask).tolist() == [1.0, 0.0]


def test_a_masked_token_changes_nothing():
    import torch

    from gpu_jobs.algos.sft import sft_loss

    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.4).long()
    mask[:, 0] = 1
    changed = torch.where(mask.bool(), log_prob, torch.full_like(log_prob, -1e6))
    assert sft_loss(log_prob, mask)[0].item() == sft_loss(changed, mask)[0].item()


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("data, named", [
    ({"sft": {}, "critic": {}}, "remove the critic section"),
    ({"sft": {}, "preference": {}}, "chain two runs"),
    ({"sft": {}, "trainer": {"n_gpus_per_node": 2}}, "one colocated rank"),
    ({"sft": {}, "rollout": {"temperature": 0.7}}, "temperature 1"),
    ({"sft": {}, "actor": {"kl_loss": {"use_kl_loss": True}}}, "no reference model"),
    ({"sft": {"generate": None}}, "sft.train_files empty"),
    ({"sft": {"multiturn": {"enabel": True}}}, "did you mean sft.multiturn.enable?"),
    # Where a user looks for the algorithms, SFT is named.
    ({"algorithm": {"adv_estimator": "sft"}}, "`sft: {}`"),
    ({"preference": {"algorithm": "sft"}}, "`sft: {}`"),
    ({"algorithm": {"adv_estimator": "ppo"}}, "supervised fine-tuning is `sft: {}`"),
])
def test_bad_combinations_are_one_line_naming_the_fix(data, named):
    from flows.user_errors import user_error_line
    from gpu_jobs.stages.config import ConfigError, build_run_config

    with pytest.raises(ConfigError) as err:
        build_run_config(data, check_files=False)
    line = user_error_line(err.value)
    assert named in line and "\n" not in line, line


def _write(path: Path, rows: list[dict]) -> str:
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("rows, extra, named", [
    # A verl prompt file (RL) given to SFT: no response column.
    ([{"data_source": "x", "prompt": [{"role": "user", "content": "1+1="}]}], [], "no response column"),
    # Conversations without multiturn.enable: the line says to turn it on.
    ([{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}], [],
     "set sft.multiturn.enable=true"),
    ([{"prompt": "1+1=", "response": ""}], [], "row 0: response must be non-empty text"),
    ([{"messages": [{"role": "user", "content": "1+1="}]}], ["sft.multiturn.enable=true"], "no assistant turn"),
    # verl's own example files name their columns question/answer: sft.prompt_key says where.
    ([{"question": "1+1=", "answer": "2"}], [], "name the columns with sft.prompt_key / sft.response_key"),
])
def test_a_bad_demonstrations_file_is_one_line_before_any_model_loads(tmp_path, rows, extra, named):
    from flows.user_errors import user_error_line
    from gpu_jobs.stages.sft_data import sft_frames

    url = _write(tmp_path / "demos.parquet", rows)
    cfg = _config(tmp_path, f"sft.train_files=[{url}]", *extra)
    with pytest.raises(Exception) as err:
        sft_frames(cfg)
    line = user_error_line(err.value, cfg)
    assert line is not None and named in line and url in line, line


# ------------------------------------------------------------------------------ the layout
@pytest.fixture(scope="module")
def tokenizer():
    from gpu_jobs.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("builtin"))


def test_a_prompt_and_response_row_is_the_rollouts_prompt_then_the_answer_and_eos(tokenizer, tmp_path):
    from gpu_jobs.data import render_prompt
    from gpu_jobs.stages.sft_data import sft_table

    cfg = _config(tmp_path, "sft.prompt_key=question", "sft.response_key=answer")
    rows = [{"question": "12+30=", "answer": "42"}, {"question": [{"role": "user", "content": "45+51="}],
                                                      "answer": "96"}]
    t = sft_table(rows, tokenizer, cfg).to_pylist()
    for row, laid in zip(rows, t):
        assert laid["prompt_ids"] == render_prompt(row["question"], tokenizer)  # as a rollout's prompt
        assert laid["response_ids"] == tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        assert laid["response_mask"] == [1] * len(laid["response_ids"])


def test_a_conversation_trains_on_each_assistant_turn_and_not_on_the_turns_between(tokenizer, tmp_path):
    from gpu_jobs.data import render_prompt
    from gpu_jobs.stages.sft_data import rollout_turns, sft_table

    cfg = _config(tmp_path, "sft.multiturn.enable=true")
    messages = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "[calculator(12+30)]"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": "thanks"}]  # after the last assistant turn: nothing to train on
    laid = sft_table([{"messages": messages}], tokenizer, cfg).to_pylist()[0]
    turns, eos = rollout_turns(cfg, tokenizer), [tokenizer.eos_token_id]
    call = tokenizer.encode("[calculator(12+30)]", add_special_tokens=False) + eos
    result = turns.message_ids([messages[2]])  # the rollout's tool turn after a model turn
    answer = tokenizer.encode("42", add_special_tokens=False) + eos
    assert laid["prompt_ids"] == turns.prompt(render_prompt(messages[:1], tokenizer), messages[:1])
    assert laid["response_ids"] == call + result + answer
    assert laid["response_mask"] == [1] * len(call) + [0] * len(result) + [1] * len(answer)


@pytest.mark.parametrize("which", ["builtin", "smollm2"])
def test_the_smollm2_tool_demonstrations_as_sft_rows_are_the_warm_ups_tokens(which, tmp_path):
    """The SmolLM2 tool warm-up's conversations (gpu_jobs/models/smollm2_tools.py), written as
    multi-turn SFT rows, lay out token for token as its own `demonstration` (its mask included),
    under the rollout's hermes format with the calculator: an SFT run trains on the same tokens."""
    from transformers import AutoTokenizer

    from gpu_jobs.models import ensure_builtin_model
    from gpu_jobs.models import smollm2_tools as st
    from gpu_jobs.stages.sft_data import sft_table

    if which == "smollm2":
        from gpu_jobs.models.loading import ensure_smollm2, smollm2_available

        if not smollm2_available():
            pytest.skip("SmolLM2 is not installed (make smollm2)")
        tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    else:
        tok = AutoTokenizer.from_pretrained(ensure_builtin_model())
    cfg = _config(tmp_path, "sft.multiturn.enable=true", "rollout.multi_turn.format=hermes",
                  "rollout.multi_turn.tools=[calculator]")
    problems = st.demo_problems(3, seed=7)
    laid = sft_table([{"messages": st.demonstration_messages(*p)} for p in problems], tok, cfg).to_pylist()
    turns = st.hermes_turns(tok)
    for p, row in zip(problems, laid):
        ids, mask = st.demonstration(tok, turns, *p)
        assert row["prompt_ids"] + row["response_ids"] == ids
        assert [0] * len(row["prompt_ids"]) + row["response_mask"] == mask


# ------------------------------------------------------------------------------ runs
def _history(run, roles, cfg, upto: int) -> list[dict]:
    from gpu_jobs.stages import DirectCalls, run_iteration, validate
    from storage import read_manifest

    out = [read_manifest(validate(run, roles, 0), run.storage).metrics]
    for k in range(1, upto + 1):
        uris = run_iteration(DirectCalls(run, roles), cfg, k)
        out.append({**read_manifest(validate(run, roles, k), run.storage).metrics,
                    **read_manifest(uris["commit"], run.storage).metrics})
    return out


def _greedy_reproduces(run, roles, cfg, k: int) -> None:
    """val/exact_match after update k is the share of held-out rows whose greedy decoding from
    the prompt (the hf rollout engine, with those weights) is the demonstration, EOS included."""
    from gpu_jobs.rollout import get_rollout_engine
    from gpu_jobs.rollout.base import SamplingConfig
    from storage import committed, read_manifest, read_table

    uri = committed(run.layout.stage(k, "validate"), run.storage)
    per_row = read_table(uri, storage=run.storage).to_pylist()
    folder = run.layout.policy(k)
    from gpu_jobs.stages.sft_data import sft_table

    engine = get_rollout_engine("hf", folder)
    table = sft_table([run.val.iloc[i].to_dict() for i in range(len(run.val))], run.tokenizer, cfg)
    wanted = table.column("response_ids").to_pylist()
    out = engine.generate(table.column("prompt_ids").to_pylist(), 1,
                          SamplingConfig(temperature=0.0, max_response_length=8, seed=0))
    got = [list(o["response_ids"]) for o in out]
    same = [g == w for g, w in zip(got, wanted)]
    assert [r["exact"] == 1.0 for r in per_row] == same
    assert read_manifest(uri, run.storage).metrics["val/exact_match"] == pytest.approx(sum(same) / len(same))


@pytest.mark.slow
@pytest.mark.deepspeed
def test_an_sft_run_learns_its_demonstrations_and_resumes_bitwise(tmp_path):
    """ZeRO-3, one rank: 4 iterations, a checkpoint at 2; the held-out exact match rises, the
    loss falls, and two fresh processes' views (one from checkpoint 2 plus a replay of 3 and 4,
    one from the start model replaying all four) hold the same weights bitwise."""
    import torch

    from gpu_jobs.stages import open_warm
    from storage import committed

    torch.set_num_threads(1)
    cfg = _config(tmp_path / "root", "trainer.checkpoint_every=2", "trainer.total_iterations=5")
    run, roles = open_warm(cfg)
    try:
        assert roles.rollout is None and roles.ref is None  # nothing generated, no reference
        history = _history(run, roles, cfg, 4)
        first, last = history[0], history[-1]
        assert last["val/exact_match"] > first["val/exact_match"] + 0.05, [h["val/exact_match"] for h in history]
        assert last["val/loss"] < first["val/loss"] and last["val/acc"] == last["val/exact_match"]
        assert {"train/loss", "actor/grad_norm", "actor/lr", "timing_s/sft_batch", "sft/loss_tokens"} <= last.keys()
        assert sorted(p.name for p in Path(run.layout.iteration(4)).iterdir() if p.is_dir()) == \
            ["commit", "sft_batch", "update", "validate"]
        _greedy_reproduces(run, roles, cfg, 4)
        _resume_replays_the_same_weights(cfg, roles, 4)
        # A damaged checkpoint leaves only the start model: every update replays, to the same weights.
        (Path(run.layout.trainer(2)) / "_MANIFEST.json").unlink()
        (Path(run.layout.trainer(4)) / "_MANIFEST.json").unlink()
        assert committed(run.layout.trainer(2), run.storage) is None
        _resume_replays_the_same_weights(cfg, roles, 4)
    finally:
        roles.close()


def _resume_replays_the_same_weights(cfg, roles, k: int) -> None:
    import torch

    from gpu_jobs.stages import open_warm

    _, again = open_warm(cfg)
    try:
        assert again.version == k
        mine, theirs = roles.trainer.gathered_state_dict(), again.trainer.gathered_state_dict()
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    finally:
        again.close()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_rl_chained_on_an_sft_checkpoint_records_its_source(tmp_path):
    """SFT for 2 iterations, then GRPO with model.path = its checkpoint: the RL run starts from
    exactly those weights, and its run.json names the SFT run, its uid and the iteration."""
    import torch

    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from storage import committed

    torch.set_num_threads(1)
    root = tmp_path / "root"
    sft = _config(root, "run_id=sft-first", "trainer.checkpoint_every=2", "trainer.total_iterations=2")
    run, roles = open_warm(sft)
    try:
        for k in (1, 2):
            run_iteration(DirectCalls(run, roles), sft, k)
        tuned = roles.trainer.gathered_state_dict()
    finally:
        roles.close()
    policy = run.layout.policy(2)
    rl = _config(root, "run_id=rl-second", f"model.path={policy}", "trainer.total_iterations=1",
                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", example=GRPO_EXAMPLE)
    rl_run, rl_roles = open_warm(rl)
    try:
        frozen = json.loads(Path(rl_run.layout.run_json).read_text())
        source = json.loads(Path(run.layout.run_json).read_text())
        assert frozen["model_source"] == {"run_id": "sft-first", "run_uid": source["run_uid"], "iteration": 2,
                                          "root": str(root), "kind": "sft"}
        start = rl_roles.trainer.gathered_state_dict()
        assert all(torch.equal(start[n], tuned[n]) for n in tuned)
        uris = run_iteration(DirectCalls(rl_run, rl_roles), rl, 1)
        assert committed(rl_run.layout.stage(1, "update"), rl_run.storage) == uris["update"]
    finally:
        rl_roles.close()


def test_a_model_that_is_no_run_checkpoint_has_no_source(tmp_path):
    from gpu_jobs.stages.lineage import model_source

    assert model_source("builtin") is None and model_source(str(tmp_path / "some-hf-folder")) is None
    # A checkpoint folder copied out of its run: the path says which, nothing else is known.
    assert model_source(str(tmp_path / "runs" / "gone" / "checkpoints" / "3" / "policy")) == {
        "run_id": "gone", "run_uid": None, "iteration": 3, "root": str(tmp_path), "kind": None}
