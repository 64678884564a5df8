"""rollout.ignore_eos in the run config reaches the engines' SamplingConfig (training rollouts only).

The engines' own handling of SamplingConfig.ignore_eos is tested in test_hf_engine.py and
test_vllm_engine.py (test_finish_reasons_and_eos).
"""

from __future__ import annotations

from pathlib import Path

from flows.config import load_run_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_arith.yaml"


def test_ignore_eos_is_off_by_default_and_carried_into_sampling():
    assert not load_run_config(EXAMPLE).rollout.sampling(seed=1).ignore_eos
    rollout = load_run_config(EXAMPLE, ["rollout.ignore_eos=true", "rollout.max_response_length=12"]).rollout
    sampling = rollout.sampling(seed=1)
    assert sampling.ignore_eos and sampling.max_response_length == 12 and sampling.seed == 1
    # Validation decodes greedily and must still stop on EOS to be scored.
    assert not rollout.greedy().ignore_eos
