"""LoRA on the DeepSpeed policy trainer: only adapters train, merged weights score as the trainer
does, adapter checkpoints are small and load merged, the trainer state resumes bit for bit.

    .venv/bin/python -m pytest -q tests/train/test_lora.py
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_jobs.models.lora import LoraSpec, merged_state_dict
from gpu_jobs.train import PolicyTrainer, ActorConfig

pytestmark = pytest.mark.deepspeed

CFG = dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, lr=1e-2, recompute_old_logprobs=False,
           shuffle=False, grad_clip=0.0)


def _spec(model_dir: str, rank: int = 4) -> LoraSpec:
    return LoraSpec(rank=rank, alpha=8, target_modules="all-linear", base=model_dir)


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _frozen(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if not p.requires_grad}


def _adapters(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def trained(tiny_model, helpers):
    """A LoRA trainer after two updates, with its weights before them."""
    trainer = PolicyTrainer(tiny_model, ActorConfig(**CFG), lora=_spec(tiny_model))
    before = {"frozen": _frozen(trainer), "adapters": _adapters(trainer), "merged": trainer.gathered_state_dict()}
    for seed in (0, 1):
        trainer.update(helpers.make_batch(seed, old=True))
    return trainer, before


def test_only_adapters_train_and_the_optimizer_holds_only_them(trained):
    trainer, before = trained
    trainable = {n for n, p in trainer.engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in trainer.engine.module.named_parameters() if n in trainable}
    assert _bitwise(_frozen(trainer), before["frozen"])  # every base weight bitwise unchanged
    after = _adapters(trainer)
    # lora_B starts at 0, so the first step moves B; A moves from the second step on.
    assert all(not torch.equal(after[n], before["adapters"][n]) for n in after)


def test_merged_weights_are_base_plus_scaled_product_and_score_like_the_trainer(trained, tiny_model, helpers):
    from transformers import AutoModelForCausalLM

    trainer, before = trained
    merged = trainer.gathered_state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert merged.keys() == base.state_dict().keys()  # HF names, as a full trainer hands out
    assert _bitwise(before["merged"], base.state_dict())  # lora_B starts at 0: merged = base exactly
    layer = trainer.engine.module.get_base_model().model.layers[0].self_attn.q_proj
    by_hand = layer.base_layer.weight + layer.lora_B["default"].weight @ layer.lora_A["default"].weight * (8 / 4)
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], by_hand.detach())
    # A plain model holding the merged weights gives the trainer's log-probs.
    base.load_state_dict(merged, strict=False)
    batch = helpers.make_batch(3)
    ids = batch.column("prompt_ids").to_pylist()[0] + batch.column("response_ids").to_pylist()[0]
    n_resp = len(batch.column("response_ids").to_pylist()[0])
    with torch.no_grad():
        logits = base(torch.tensor([ids])).logits[0, -n_resp - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[-n_resp:])[:, None])[:, 0]
    got = torch.as_tensor(trainer.compute_log_probs(batch.slice(0, 1))[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_adapter_checkpoint_is_small_and_loads_merged(trained, tiny_model, tmp_path):
    from gpu_jobs.models.loading import read_state_dict, resolve_model_path
    from storage import copy_checkpoint, read_index

    trainer, _ = trained
    url = str(tmp_path / "policy")
    trainer.save_hf(url)
    names = set(os.listdir(url))
    assert {"adapter_config.json", "adapter_model.safetensors", "rlmill_base.json"} <= names
    assert not any(n.startswith("model-") for n in names)
    assert read_index(url).extra["lora"] == {"path": tiny_model, "seed": 0}
    adapter_bytes = os.path.getsize(os.path.join(url, "adapter_model.safetensors"))
    full_bytes = sum(v.numel() * 4 for v in trainer.gathered_state_dict().values())
    assert adapter_bytes < full_bytes / 3
    merged = read_state_dict(url)
    for name, tensor in trainer.gathered_state_dict().items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=1e-6)
    # Building an engine from the folder gets a plain HF folder merged by peft: the same weights.
    folder = resolve_model_path(url)
    assert folder != url and not os.path.exists(os.path.join(folder, "adapter_config.json"))
    from safetensors.torch import load_file

    by_peft = load_file(os.path.join(folder, "model.safetensors"))
    for name, tensor in by_peft.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=1e-6)
    # A promoted copy (nightly) is the same adapter and merges to the same weights; so does one
    # in object storage (downloaded, then merged).
    copy = copy_checkpoint(url, str(tmp_path / "promoted"))
    assert _bitwise(read_state_dict(copy), merged)
    remote = copy_checkpoint(url, f"memory://lora-{os.getpid()}-{tmp_path.name}/policy")
    assert _bitwise(read_state_dict(remote), merged)


def test_trainer_state_resumes_bitwise_and_holds_no_base_weights(trained, tiny_model, helpers, tmp_path):
    trainer, _ = trained
    url = str(tmp_path / "trainer")
    trainer.save(url)
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(url) for f in fs)
    base_bytes = sum(p.numel() * 4 for p in _frozen(trainer).values())
    assert stored < base_bytes  # adapters + their Adam moments only
    fresh = PolicyTrainer(tiny_model, ActorConfig(**CFG), lora=_spec(tiny_model))
    fresh.load(url)
    assert _bitwise(_adapters(fresh), _adapters(trainer)) and _bitwise(_frozen(fresh), _frozen(trainer))
    batch = helpers.make_batch(5, old=True)
    trainer.update(batch)
    fresh.update(batch)
    assert _bitwise(_adapters(fresh), _adapters(trainer))


def test_reference_is_the_base_model(trained, tiny_model, helpers):
    from gpu_jobs.train import RefModel

    trainer, _ = trained
    batch = helpers.make_batch(7)
    ref = RefModel(tiny_model, ActorConfig(**CFG)).compute_log_probs(batch)
    off = trainer.reference().compute_log_probs(batch)
    on = trainer.compute_log_probs(batch)
    for a, b in zip(off, ref):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-6, rtol=1e-6)
    assert any(not torch.allclose(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(on, ref))
    assert trainer.engine.module.active_adapter == "default"  # switched back on after the pass


def test_merge_adapter_tensors_by_hand():
    from gpu_jobs.models.lora import adapter_scaling, merge_adapter_tensors

    base = {"m.q.weight": torch.zeros(2, 3), "m.k.weight": torch.ones(2, 3)}
    # B (2, 1) @ A (1, 3) = [[1, 2, 3], [2, 4, 6]]; alpha 4 / r 1 scales it by 4.
    adapter = {"base_model.model.m.q.lora_A.weight": torch.tensor([[1.0, 2.0, 3.0]]),
               "base_model.model.m.q.lora_B.weight": torch.tensor([[1.0], [2.0]])}
    scaling = adapter_scaling({"r": 1, "lora_alpha": 4})
    out = merge_adapter_tensors(base, adapter, scaling)
    assert torch.equal(out["m.q.weight"], torch.tensor([[4.0, 8.0, 12.0], [8.0, 16.0, 24.0]]))
    assert out["m.k.weight"] is base["m.k.weight"]  # not adapted: untouched
    assert adapter_scaling({"r": 4, "lora_alpha": 8, "use_rslora": True}) == 4.0  # alpha / sqrt(r)
    with pytest.raises(ValueError, match="does not have"):
        merge_adapter_tensors({"m.k.weight": torch.ones(2, 3)}, adapter, scaling)


def test_merged_state_dict_does_not_touch_the_model(tiny_model):
    from transformers import AutoModelForCausalLM

    from gpu_jobs.models.lora import apply_lora

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), _spec(tiny_model, rank=2))
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            torch.nn.init.normal_(p)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged_state_dict(model)
    assert _bitwise(params, {n: p.detach() for n, p in model.named_parameters()})


def test_unknown_target_module_is_a_clear_error(tiny_model):
    from transformers import AutoModelForCausalLM

    from gpu_jobs.models.lora import apply_lora

    spec = LoraSpec(rank=2, alpha=4, target_modules=("no_such_proj",), base=tiny_model)
    with pytest.raises(ValueError, match="model.target_modules"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), spec)


@pytest.mark.parametrize("extra, message", [
    (["trainer.n_gpus_per_node=2"], "trainer.n_gpus_per_node=1"),
    (["actor.zero_stage=3"], "actor.zero_stage=auto"),
    (["model.target_modules=[]"], "model.target_modules is an empty list"),
    (["model.lora_alpha=0"], "model.lora_alpha"),
])
def test_lora_config_errors_name_the_fix(extra, message, tmp_path):
    from flows.config import load_run_config
    from gpu_jobs.stages.config import ConfigError
    from tests.tiny import EXAMPLE, tiny_overrides

    with pytest.raises(ConfigError, match=message):
        load_run_config(EXAMPLE, tiny_overrides(str(tmp_path), "model.lora_rank=8", *extra))
    if not extra[0].startswith("model."):  # the same settings are fine without LoRA
        load_run_config(EXAMPLE, tiny_overrides(str(tmp_path), *extra))
