"""Exact resume (bitwise on CPU fp32, 1 rank), checkpoints of other models, and bad inputs that
must fail before any weight changes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gpu_jobs.algos import AdaptiveKLController
from gpu_jobs.train import PolicyTrainer, ActorConfig, TrainInputError

pytestmark = pytest.mark.deepspeed

CFG = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3, lr=1e-3,
                    lr_warmup_steps=3, entropy_coeff=0.01, seed=3)


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _stable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s", "perf/throughput"))}


def test_resume_equals_no_stop_bitwise(tiny_model, helpers, tmp_path):
    batches = [helpers.make_batch(seed=s, prompts=4, n=2) for s in (11, 12, 13)]

    def kl():
        return AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)

    straight = PolicyTrainer(tiny_model, CFG, kl_controller=kl())
    expected = []
    for b in batches:
        expected.append(_stable(straight.update(b)))
        straight.kl_controller.update(current_kl=2.0, n_steps=8)

    first = PolicyTrainer(tiny_model, CFG, kl_controller=kl())
    assert _stable(first.update(batches[0])) == expected[0]
    first.kl_controller.update(current_kl=2.0, n_steps=8)
    assert first.save(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "_MANIFEST.json")
    with pytest.raises(Exception, match="already committed"):  # never over the last good one
        first.save(str(tmp_path / "ckpt"))

    resumed = PolicyTrainer(tiny_model, CFG, kl_controller=kl())
    resumed.load(str(tmp_path / "ckpt"))
    assert (resumed.step, resumed.samples_seen) == (1, 8)
    got = []
    for b in batches[1:]:
        got.append(_stable(resumed.update(b)))
        resumed.kl_controller.update(current_kl=2.0, n_steps=8)
    assert got == expected[1:]  # same lr (warm-up step), same shuffle, same losses
    assert _equal(resumed.gathered_state_dict(), straight.gathered_state_dict())
    assert resumed.kl_controller.value == straight.kl_controller.value


def test_checkpoint_of_another_model_is_rejected_before_loading(tiny_model, helpers, tmp_path):
    other_dir = helpers.build_tiny(str(tmp_path / "other"), hidden=32)
    other = PolicyTrainer(other_dir, ActorConfig())
    other.save(str(tmp_path / "other_ckpt"))
    trainer = PolicyTrainer(tiny_model, ActorConfig())
    before = trainer.gathered_state_dict()
    with pytest.raises(TrainInputError, match="different model") as e:
        trainer.load(str(tmp_path / "other_ckpt"))
    assert "[64, 64] vs" in str(e.value) or "vs [64" in str(e.value)
    with pytest.raises(TrainInputError, match="no trainer state"):
        trainer.load(str(tmp_path / "nothing_here"))
    assert _equal(trainer.gathered_state_dict(), before)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_checkpoint_file_damaged_after_save_is_named_and_nothing_loads(tiny_model, helpers, tmp_path, damage):
    from storage import CorruptShardError, verify

    saved = PolicyTrainer(tiny_model, CFG)
    saved.update(helpers.make_batch(seed=5, prompts=4, n=2))
    url = str(tmp_path / "ckpt")
    saved.save(url)
    # The state lands in the folder given (checkpoints/<k>/trainer/, no trainer/trainer/) as one
    # commit of storage's primitive, checked by its one verifier.
    assert not (tmp_path / "ckpt" / "trainer").exists()
    assert verify(url).kind == "trainer"
    victim = max((p for p in (tmp_path / "ckpt").rglob("*.pt")), key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    if damage == "flip":
        mid = len(data) // 2
        victim.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 4]) + data[mid + 4:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.unlink()
    trainer = PolicyTrainer(tiny_model, CFG)
    before = trainer.gathered_state_dict()
    with pytest.raises(CorruptShardError, match=victim.name):
        verify(url)
    with pytest.raises(CorruptShardError, match=victim.name):
        trainer.load(url)
    assert _equal(trainer.gathered_state_dict(), before) and trainer.step == 0


def test_trainer_state_round_trips_on_every_backend(tiny_model, helpers, storage_root):
    """save/load through the storage suite's backends (local, memory://, moto S3); a flipped byte
    in the object store is named by the verifier before anything loads."""
    from storage import CorruptShardError, join, read_manifest, url_to_fs

    s = storage_root.storage
    url = join(storage_root.url, "checkpoints", "1", "trainer")
    saved = PolicyTrainer(tiny_model, CFG, storage=s)
    saved.update(helpers.make_batch(seed=5, prompts=4, n=2))
    saved.save(url)
    resumed = PolicyTrainer(tiny_model, CFG, storage=s)
    resumed.load(url)
    assert resumed.step == 1 and _equal(resumed.gathered_state_dict(), saved.gathered_state_dict())
    m = read_manifest(url, s)
    victim = max(m.files, key=lambda f: f.size)
    fs, path = url_to_fs(m.url_of(victim), s)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    fresh = PolicyTrainer(tiny_model, CFG, storage=s)
    with pytest.raises(CorruptShardError, match=victim.path.rsplit("/", 1)[-1]):
        fresh.load(url)
    assert fresh.step == 0


# ---- bad inputs ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kl_trainer(tiny_model):
    cfg = ActorConfig(ppo_mini_batch_size=2, lr=1e-2, kl_loss={"use_kl_loss": True})
    return PolicyTrainer(tiny_model, cfg)


def _with(table, name, values):
    i = table.column_names.index(name)
    return table.set_column(i, name, pa.array(values, pa.list_(pa.float32())))


def _bad_batches(helpers):
    good = helpers.make_batch(seed=5, prompts=2, n=2, ref=True)
    adv = good.column("advantages").to_pylist()
    nan = [list(a) for a in adv]
    nan[1][0] = float("nan")
    short = [list(a) for a in adv]
    short[2] = short[2] + [0.0]
    return {
        "missing advantages": (good.drop(["advantages"]), "missing column(s) ['advantages']"),
        "missing ref_logprobs": (good.drop(["ref_logprobs"]), "use_kl_loss=false"),
        "nan advantage": (_with(good, "advantages", nan), "row 1 token 0 is nan"),
        "empty batch": (good.slice(0, 0), "empty batch"),
        "length mismatch": (_with(good, "advantages", short), "values but the response has"),
        "not a table": (None, "empty batch"),
    }


def test_bad_inputs_fail_before_weights_change(kl_trainer, helpers):
    before = kl_trainer.gathered_state_dict()
    for name, (table, needle) in _bad_batches(helpers).items():
        with pytest.raises(TrainInputError) as e:
            kl_trainer.update(table)
        assert needle in str(e.value), name
    assert kl_trainer.step == 0
    assert _equal(kl_trainer.gathered_state_dict(), before)
    # and the trainer is still usable afterwards
    m = kl_trainer.update(helpers.make_batch(seed=5, prompts=2, n=2, ref=True))
    assert np.isfinite(m["actor/kl_loss"]) and kl_trainer.step == 1
    assert not _equal(kl_trainer.gathered_state_dict(), before)
