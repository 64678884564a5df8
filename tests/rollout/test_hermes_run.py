"""A tiny 2-iteration GRPO slice with rollout.multi_turn.format=hermes on the built-in model,
through the stages (stage functions called directly, no Prefect server): the Hermes path
(tool splice, parsing, metrics) runs in a training loop. The built-in model was never taught
the format, so it answers directly; the mechanics with tool turns are in test_hermes.py.

    .venv/bin/python -m pytest -q tests/rollout/test_hermes_run.py
"""

from __future__ import annotations

import pytest

from tests.tiny import EXAMPLE, tiny_overrides


@pytest.mark.slow
@pytest.mark.deepspeed
def test_two_iterations_with_hermes_tools_on_the_builtin_model(tmp_path):
    import torch

    from flows.config import load_run_config
    from gpu_jobs.rollout.agent_loop import AgentLoopEngine
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from gpu_jobs.stages.shell import read
    from storage import read_manifest

    torch.set_num_threads(1)
    cfg = load_run_config(EXAMPLE, tiny_overrides(
        str(tmp_path / "root"), "trainer.total_iterations=2", "trainer.checkpoint_every=2", "trainer.val_every=0",
        "rollout.max_response_length=16", "rollout.multi_turn.enable=true", "rollout.multi_turn.format=hermes",
        "rollout.multi_turn.max_assistant_turns=2", "rollout.multi_turn.max_parallel_calls=2"))
    run, eng = open_warm(cfg)
    assert isinstance(eng.rollout, AgentLoopEngine) and eng.rollout.turns.native is False
    uris = [run_iteration(DirectCalls(run, eng), cfg, k) for k in (1, 2)]
    rollout = read(run, uris[0]["rollout"])
    masks, lens = rollout.column("response_mask").to_pylist(), rollout.column("response_len").to_pylist()
    assert all(len(m) == n <= 16 for m, n in zip(masks, lens))
    metrics = read_manifest(uris[1]["commit"], run.storage).metrics
    for name in ("multi_turn/malformed_calls", "multi_turn/tool_call_frac", "actor/pg_loss", "critic/score/mean"):
        assert name in metrics, name
