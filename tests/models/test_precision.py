"""`auto` precision: bf16 where the machine computes it natively, else fp32, resolved when a
config is read (gpu_jobs/models/precision.py)."""

from __future__ import annotations

import pytest

from gpu_jobs.models import precision

X86 = """processor\t: 0
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
X86_OLD = "flags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 bf16 i8mm\n"


def test_cpu_flags_read_x86_and_arm_cpuinfo():
    assert precision.cpu_flags(X86) & precision.BF16_CPU_FLAGS == {"avx512_bf16"}
    assert not precision.cpu_flags(X86_OLD) & precision.BF16_CPU_FLAGS  # AVX-512 alone emulates bf16
    assert precision.cpu_flags(ARM) & precision.BF16_CPU_FLAGS == {"bf16"}
    assert precision.cpu_flags("model name\t: some cpu\n") == set()


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_both_sides_alike_when_the_config_is_read(monkeypatch, native):
    from gpu_jobs.rollout import RolloutEngineConfig
    from gpu_jobs.train import ActorConfig

    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    assert ActorConfig(dtype="auto").dtype == ("bf16" if native else "fp32")
    assert RolloutEngineConfig(dtype="auto").dtype == ("bfloat16" if native else "float32")
    # An explicit precision is kept whatever the machine.
    assert ActorConfig(dtype="fp32").dtype == "fp32" and RolloutEngineConfig(dtype="bfloat16").dtype == "bfloat16"


def test_the_smollm2_example_runs_one_precision_on_both_engines(monkeypatch, tmp_path):
    from flows.config import load_run_config
    from tests.tiny import REPO

    for native, want in ((True, ("bf16", "bfloat16", 3e-2)), (False, ("fp32", "float32", 1e-3))):
        monkeypatch.setattr(precision, "native_bf16", lambda native=native: native)
        cfg = load_run_config(REPO / "examples" / "grpo_times_smollm2.yaml", [f"root={tmp_path}"])
        got = (cfg.actor.dtype, cfg.rollout.engine_options.dtype, cfg.agreement.threshold(cfg.rollout, cfg.actor))
        assert got == want


def test_a_wrong_precision_names_the_choices(tmp_path):
    from flows.config import ConfigError, load_run_config
    from tests.tiny import REPO

    with pytest.raises(ConfigError, match="actor.dtype: .*'bf32' is not a precision: use 'auto', 'fp32', 'bf16'"):
        load_run_config(REPO / "examples" / "grpo_times_smollm2.yaml", [f"root={tmp_path}", "actor.dtype=bf32"])
    with pytest.raises(ConfigError, match="engine_options.dtype: .*use 'auto', 'float32', 'bfloat16', 'float16'"):
        load_run_config(REPO / "examples" / "grpo_times_smollm2.yaml",
                        [f"root={tmp_path}", "rollout.engine_options.dtype=fp16"])
