"""safetensors checkpoints on every backend: bit-exact round trips, HF loading, commit marker,
corruption detection."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from storage import (  # noqa: E402 - after the importorskip
    INDEX_NAME,
    CorruptShardError,
    ManifestExistsError,
    NotCommittedError,
    copy_checkpoint,
    download_checkpoint,
    join,
    load_state_dict,
    save_checkpoint,
    url_to_fs,
    verify,
)


def random_state_dict(seed: int = 0) -> dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "a.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(128, 64, generator=g).half(),
        "b.steps": torch.arange(10, dtype=torch.int64),
        "c.empty": torch.zeros(0, 4),
        "d.transposed": torch.randn(16, 8, generator=g).t(),  # non-contiguous
    }


def assert_bit_exact(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8) if a[k].numel() else a[k],
                           b[k].contiguous().view(torch.uint8) if b[k].numel() else b[k]), k


def test_round_trip_bit_exact_multi_shard(storage_root):
    s = storage_root.storage
    sd = random_state_dict()
    url = join(storage_root.url, "ckpt")
    assert save_checkpoint(url, sd, config={"model_type": "toy"}, shard_bytes=8 << 10, storage=s) == url
    fs, path = url_to_fs(url, s)
    index = json.loads(fs.cat_file(join(path, INDEX_NAME)))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert_bit_exact(sd, load_state_dict(url, storage=s))
    with pytest.raises(ManifestExistsError):
        save_checkpoint(url, sd, config={"model_type": "toy"}, storage=s)


def test_shared_tensors_are_cloned(storage_root):
    w = torch.randn(8, 4)
    sd = {"embed.weight": w, "lm_head.weight": w, "view": w[2:4]}
    url = join(storage_root.url, "tied")
    save_checkpoint(url, sd, config={}, storage=storage_root.storage)
    back = load_state_dict(url, storage=storage_root.storage)
    assert torch.equal(back["embed.weight"], w) and torch.equal(back["lm_head.weight"], w)
    assert torch.equal(back["view"], w[2:4])


def test_folder_without_index_is_not_a_checkpoint(storage_root):
    s = storage_root.storage
    url = join(storage_root.url, "ckpt")
    save_checkpoint(url, random_state_dict(), config={}, storage=s)
    fs, path = url_to_fs(url, s)
    fs.rm_file(join(path, INDEX_NAME))
    with pytest.raises(NotCommittedError):
        load_state_dict(url, storage=s)
    with pytest.raises(NotCommittedError):
        download_checkpoint(url, storage=s)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_names_the_file(storage_root, damage):
    s = storage_root.storage
    url = join(storage_root.url, "ckpt")
    save_checkpoint(url, random_state_dict(), config={}, shard_bytes=8 << 10, storage=s)
    fs, path = url_to_fs(url, s)
    name = sorted(set(json.loads(fs.cat_file(join(path, INDEX_NAME)))["weight_map"].values()))[1]
    shard = join(path, name)
    data = bytearray(fs.cat_file(shard))
    if damage == "flip":
        data[-1] ^= 0xFF
        fs.pipe_file(shard, bytes(data))
    elif damage == "truncate":
        fs.pipe_file(shard, bytes(data[:-7]))
    else:
        fs.rm_file(shard)
    with pytest.raises(CorruptShardError, match=name):
        load_state_dict(url, storage=s)


def test_the_index_is_the_manifest_of_every_file(storage_root, tmp_path):
    """The HF index is the folder's manifest: every file (config too) is verified by storage's
    one verifier, and a download checks each file as it lands."""
    s = storage_root.storage
    url = join(storage_root.url, "ckpt")
    save_checkpoint(url, random_state_dict(), config={"model_type": "toy"}, shard_bytes=8 << 10,
                    extra_files={"generation_config.json": b"{}"}, storage=s)
    m = verify(url, s, name=INDEX_NAME, kind="checkpoint")
    listed = {f.path for f in m.files}
    assert {"config.json", "generation_config.json"} | set(m.extra["weight_map"].values()) == listed
    fs, path = url_to_fs(url, s)
    fs.pipe_file(join(path, "config.json"), b'{"model_type": "evil"}')
    with pytest.raises(CorruptShardError, match="config.json"):
        verify(url, s, name=INDEX_NAME)
    with pytest.raises(CorruptShardError, match="config.json"):
        download_checkpoint(url, local_dir=str(tmp_path / "dl"), storage=s)


def test_copy_checkpoint_commits_a_verified_copy(storage_root):
    s = storage_root.storage
    sd = random_state_dict()
    src = save_checkpoint(join(storage_root.url, "run", "policy"), sd, config={}, shard_bytes=8 << 10, storage=s)
    dest = copy_checkpoint(src, join(storage_root.url, "models", "v1"), s)
    assert_bit_exact(sd, load_state_dict(dest, storage=s))
    assert copy_checkpoint(src, dest, s) == dest  # committed already: a retry changes nothing
    fs, path = url_to_fs(src, s)
    name = sorted(set(json.loads(fs.cat_file(join(path, INDEX_NAME)))["weight_map"].values()))[1]
    data = bytearray(fs.cat_file(join(path, name)))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(join(path, name), bytes(data))
    with pytest.raises(CorruptShardError, match=f"{name}: sha256"):
        copy_checkpoint(src, join(storage_root.url, "models", "v2"), s)
    with pytest.raises(NotCommittedError):  # the damaged copy was never published
        load_state_dict(join(storage_root.url, "models", "v2"), storage=s)


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_from_pretrained_gives_identical_logits(storage_root, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RLMILL_CACHE_DIR", str(tmp_path / "cache"))
    s = storage_root.storage
    model = tiny_qwen2()
    url = join(storage_root.url, "policy")
    save_checkpoint(url, model.state_dict(), config=model.config, shard_bytes=32 << 10, storage=s)
    local = download_checkpoint(url, storage=s)
    assert download_checkpoint(url, storage=s) == local  # cached copy reused
    loaded = AutoModelForCausalLM.from_pretrained(local).eval()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert_bit_exact(model.state_dict(), {k: v for k, v in loaded.state_dict().items()})


def test_tokenizer_and_extra_files_travel(storage_root, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate("<>0123456789+=")}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<")),
                                  eos_token=">", pad_token="<")
    s = storage_root.storage
    url = join(storage_root.url, "policy")
    save_checkpoint(url, {"w": torch.ones(2)}, config={"model_type": "toy"}, tokenizer=tok,
                    extra_files={"generation_config.json": b"{}"}, storage=s)
    local = download_checkpoint(url, local_dir=str(tmp_path / "dl"), storage=s)
    back = PreTrainedTokenizerFast.from_pretrained(local)
    assert back.eos_token == ">" and back.get_vocab() == tok.get_vocab()
    assert (tmp_path / "dl" / "generation_config.json").read_bytes() == b"{}"
    assert json.loads((tmp_path / "dl" / "config.json").read_text())["model_type"] == "toy"


def test_import_storage_does_not_import_torch():
    import subprocess
    import sys

    code = "import storage, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
