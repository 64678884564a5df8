"""A LoRA run through the stages (no Prefect): only adapters train, the rollout engine gets the
merged weights (the agreement probe passes every update), checkpoints hold the adapter and a
pointer to the base, a resumed run ends bitwise where an uninterrupted one does, and the nightly
flow's promotion and merged export work on the adapter folder.

    .venv/bin/python -m pytest -q tests/flows/test_lora_run.py
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
from storage import read_manifest

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

LORA = ("model.lora_rank=8", "model.lora_alpha=16", "actor.lr=1e-3", "trainer.total_iterations=3",
        "trainer.checkpoint_every=2", "actor.kl_loss.use_kl_loss=true")


def _params(roles, trainable: bool) -> dict[str, torch.Tensor]:
    module = roles.trainer.engine.module
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad == trainable}


def _bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Three iterations of a tiny LoRA GRPO run (KL loss on: the reference is the adapter-off actor)."""
    from flows.config import load_run_config
    from tests.tiny import EXAMPLE, tiny_overrides

    torch.set_num_threads(1)
    cfg = load_run_config(EXAMPLE, tiny_overrides(str(tmp_path_factory.mktemp("lora") / "root"), *LORA))
    run, roles = open_warm(cfg)
    start = {"frozen": _params(roles, False), "adapters": _params(roles, True)}
    uris, merged_at = [], {}
    for k in (1, 2, 3):
        uris.append(run_iteration(DirectCalls(run, roles), cfg, k))
        merged_at[k] = roles.trainer.gathered_state_dict()
    return cfg, run, roles, start, uris, merged_at


def test_only_adapters_change_and_the_optimizer_holds_them(lora_run):
    _, _, roles, start, _, _ = lora_run
    _bitwise(_params(roles, False), start["frozen"])
    after = _params(roles, True)
    assert after and all(".lora_" in n for n in after)
    assert all(not torch.equal(after[n], start["adapters"][n]) for n in after if ".lora_B." in n)
    held = [p for g in roles.trainer.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in held) == sum(t.numel() for t in after.values())
    assert sum(t.numel() for t in after.values()) < sum(t.numel() for t in start["frozen"].values()) / 5


def test_agreement_passes_with_merged_weights_in_the_rollout_engine(lora_run):
    cfg, run, _, _, uris, _ = lora_run
    limit = cfg.agreement.threshold(cfg.rollout, cfg.actor)
    assert limit is not None
    for k, u in enumerate(uris, 1):
        m = read_manifest(u["update"], run.storage).metrics
        # iterations 2 and 3 sample with weights synced in memory after an update
        assert m["training/agreement_tokens"] > 0 and m["training/rollout_probs_diff_mean"] <= limit, k
        assert "actor/kl_loss" in m
    # The reference is the base model: at iteration 1 the rollout sampled with the base (the
    # adapter's B starts at 0), so the reference log-probs are the rollout's own.
    from gpu_jobs.stages.agreement import rows_agreement
    from gpu_jobs.stages.shell import read

    rollout, ref = read(run, uris[0]["rollout"]), read(run, uris[0]["logprobs"])
    ref_of = dict(zip(ref.column("uid").to_pylist(), ref.column("ref_logprobs").to_pylist()))
    gap = rows_agreement(rollout.column("rollout_logprobs").to_pylist(),
                         [ref_of[u] for u in rollout.column("uid").to_pylist()])
    assert gap["training/rollout_logprobs_diff_max"] < 1e-4
    # At iteration 3 the actor has moved; its adapter-off reference still scores as the base.
    from gpu_jobs.train import RefModel

    batch, ref = read(run, uris[2]["rollout"]), read(run, uris[2]["logprobs"])
    base = RefModel(run.model_path, cfg.actor, tokenizer=run.tokenizer).compute_log_probs(batch)
    ref_of = dict(zip(ref.column("uid").to_pylist(), ref.column("ref_logprobs").to_pylist()))
    gap = rows_agreement([ref_of[u] for u in batch.column("uid").to_pylist()], base)
    assert gap["training/rollout_logprobs_diff_max"] < 1e-4
    moved = rows_agreement(batch.column("rollout_logprobs").to_pylist(), base)  # the adapter-on policy
    assert moved["training/rollout_logprobs_diff_max"] > 1e-3


def test_checkpoint_policy_folder_is_the_adapter_and_a_base_pointer(lora_run):
    from gpu_jobs.models.loading import read_state_dict
    from storage import read_index

    cfg, run, _, _, _, merged_at = lora_run
    folder = run.layout.policy(2)
    files = {f.path: f.size for f in read_index(folder, run.storage).files}
    assert {"adapter_config.json", "adapter_model.safetensors", "rlmill_base.json"} <= files.keys()
    assert not any(name.startswith("model-") for name in files)
    assert read_index(folder, run.storage).extra["lora"] == {"path": cfg.model.path, "seed": cfg.model.seed}
    full = sum(t.numel() * 4 for t in merged_at[2].values())
    assert sum(files.values()) < full / 3
    # What a rollout engine loads from storage (resume, remote placement) is the merged model.
    loaded = read_state_dict(folder, run.storage)
    for name, tensor in merged_at[2].items():
        torch.testing.assert_close(loaded[name], tensor, atol=1e-6, rtol=1e-6)


def test_resumed_run_ends_with_the_same_weights(lora_run):
    cfg, _, roles, _, _, merged_at = lora_run
    # A fresh process: checkpoint 2 (adapters + Adam moments) + replay of update 3; its start
    # probe re-checks agreement with the rollout engine synced from the restored trainer.
    _, resumed = open_warm(cfg)
    assert resumed.version == 3
    _bitwise(_params(resumed, True), _params(roles, True))
    _bitwise(_params(resumed, False), _params(roles, False))
    _bitwise(resumed.trainer.gathered_state_dict(), merged_at[3])
    resumed.close()


def test_nightly_promotes_the_adapter_and_exports_a_merged_folder(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from flows.nightly import export_merged, export_url, promote_version
    from storage import ModelLayout, read_index

    cfg, run, _, _, _, merged_at = lora_run
    models = ModelLayout(str(tmp_path / "reg"), "arith")
    version = promote_version(run.layout.policy(3), models, "v1")
    assert models.current_version() == "v1"
    assert "lora" in read_index(version).extra  # the adapter + base pointer, not full weights
    out = export_merged(version, export_url(models, "v1"))
    assert "lora" not in read_index(out).extra
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in merged_at[3].items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=1e-6)
    assert export_merged(version, out) == out  # committed already: a retry changes nothing


@pytest.mark.vllm
def test_lora_with_vllm_gets_merged_weights_in_memory_and_from_storage(tiny_config):
    """vLLM (tied output head on the built-in model) follows a LoRA trainer: synced in memory
    after each update, and loaded from the adapter folder in storage (merged on load)."""
    from gpu_jobs import stages

    cfg = tiny_config("rollout.engine=vllm", "model.lora_rank=4", "actor.lr=1e-3", "trainer.total_iterations=2",
                      "trainer.checkpoint_every=1")
    run, eng = open_warm(cfg)
    uris = [run_iteration(DirectCalls(run, eng), cfg, k) for k in (1, 2)]
    assert read_manifest(uris[1]["update"], run.storage).metrics["training/rollout_probs_diff_mean"] < 1e-4
    assert stages.probe_agreement(run, eng, "in-memory sync")["training/rollout_logprobs_diff_max"] < 1e-3
    eng.rollout.update_weights(run.layout.policy(2))  # what a resumed or remote rollout loads
    assert stages.probe_agreement(run, eng, "from storage")["training/rollout_logprobs_diff_max"] < 1e-3
    eng.close()


def test_a_run_from_a_promoted_adapter_chains_its_base(lora_run, tmp_path):
    """The next night trains from the promoted adapter: its base is that adapter merged, and its
    own checkpoints point at the promoted version (merged recursively on load)."""
    from flows.config import load_run_config
    from flows.nightly import promote_version
    from gpu_jobs.models.loading import read_state_dict
    from storage import ModelLayout, read_index
    from tests.tiny import EXAMPLE, tiny_overrides

    _, run, _, _, _, merged_at = lora_run
    version = promote_version(run.layout.policy(3), ModelLayout(str(tmp_path / "reg"), "arith"), "v1")
    cfg = load_run_config(EXAMPLE, tiny_overrides(str(tmp_path / "night2"), "model.lora_rank=4", "actor.lr=1e-3",
                                                  f"model.path={version}", "trainer.total_iterations=1"))
    night2, roles = open_warm(cfg)  # its start probe: the merged promoted model in both engines
    start = roles.trainer.gathered_state_dict()
    for name, tensor in merged_at[3].items():
        torch.testing.assert_close(start[name], tensor, atol=1e-6, rtol=1e-6)
    run_iteration(DirectCalls(night2, roles), cfg, 1)
    assert read_index(night2.layout.policy(1)).extra["lora"]["path"] == version
    loaded, now = read_state_dict(night2.layout.policy(1)), roles.trainer.gathered_state_dict()
    for name, tensor in now.items():
        torch.testing.assert_close(loaded[name], tensor, atol=1e-6, rtol=1e-6)
    roles.close()
