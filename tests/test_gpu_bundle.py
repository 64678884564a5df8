"""`make gpu-bundle` (scripts/gpu_bundle.py): its lock, size accounting and refusal, offline.

    .venv/bin/python -m pytest -q tests/test_gpu_bundle.py

Downloading the wheels needs the network and is not run here (`make gpu-bundle` does it).
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from scripts import gpu_bundle as gb

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def test_the_lock_holds_every_top_requirement_at_its_pin():
    lock = dict(gb.read_lock())
    assert len(lock) == len(gb.read_lock())  # one line per distribution
    for req in gb.TOP:
        name, version = req.split("==")
        assert lock[gb.normalize(name)] == version, req
    # Nothing the GPU machine already has travels: its torch and transformers stay.
    assert not {"torch", "transformers", "accelerate", "peft", "pyarrow", "numpy", "pytest"} & set(lock)


def test_the_lock_agrees_with_the_pins_of_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lock = dict(gb.read_lock())
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", dep.split("#")[0].strip())
        if m and gb.normalize(m.group(1)) in lock:
            assert lock[gb.normalize(m.group(1))] == m.group(2), dep


def test_read_lock_refuses_a_line_without_a_version(tmp_path):
    bad = tmp_path / "lock.txt"
    bad.write_text("# a comment\nprefect==3.7.7\npandas\n")
    with pytest.raises(ValueError, match="'pandas' is not name==version"):
        gb.read_lock(bad)
    bad.write_text("Great_Expectations==1.24.1  # why\n\n")
    assert gb.read_lock(bad) == [("great-expectations", "1.24.1")]


def test_verdict_fits_or_refuses_in_one_line_naming_the_largest():
    items = {"wheels/scipy-1.17.1-cp312.whl": 34 * MIB, "wheels/prefect-3.7.7-py3-none-any.whl": 14 * MIB,
             "wheels/six-1.17.0-py2.py3-none-any.whl": MIB // 10, "smollm2/": 3 * MIB}
    fits, line = gb.verdict(items, tree=3 * MIB, limit=64 * MIB)
    assert fits and line.startswith("fits: 54.1 MiB to carry (bundle 51.1 MiB + working tree 3.0 MiB)")
    fits, line = gb.verdict(items, tree=3 * MIB, limit=50 * MIB, largest=2)
    assert not fits and "\n" not in line
    assert line.startswith("refused: 54.1 MiB to carry") and "4.1 MiB over" in line
    assert line.endswith("largest: scipy-1.17.1-cp312.whl 34.0 MiB, prefect-3.7.7-py3-none-any.whl 14.0 MiB")


def test_folder_items_counts_each_wheel_and_each_other_folder(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "a-1-py3-none-any.whl").write_bytes(b"x" * 10)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_bytes(b"y" * 3)
    (tmp_path / "smollm2" / "tokenizer.json").write_bytes(b"z" * 4)
    assert gb.folder_items(tmp_path) == {"smollm2/": 7, "wheels/a-1-py3-none-any.whl": 10}


def test_tree_bytes_counts_what_travels_not_what_git_ignores(tmp_path):
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / ".gitignore").write_text("gpu_bundle/\n")  # 12 bytes
    (tmp_path / "tracked.py").write_bytes(b"a" * 100)
    run("add", ".gitignore", "tracked.py")
    (tmp_path / "untracked.txt").write_bytes(b"b" * 50)
    (tmp_path / "gpu_bundle").mkdir()
    (tmp_path / "gpu_bundle" / "big.whl").write_bytes(b"c" * 5000)
    assert gb.tree_bytes(tmp_path) == 12 + 100 + 50


def test_copy_model_files_takes_config_and_tokenizer_not_weights(tmp_path):
    src, dest = tmp_path / "model", tmp_path / "out"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "model.safetensors"):
        (src / name).write_text(name)
    assert gb.copy_model_files(src, dest) == ["config.json", "tokenizer.json", "chat_template.jinja"]
    assert sorted(p.name for p in dest.iterdir()) == ["chat_template.jinja", "config.json", "tokenizer.json"]
    with pytest.raises(FileNotFoundError, match="no config.json"):
        gb.copy_model_files(dest / "nothing", tmp_path / "x")


def test_the_box_line_installs_offline_then_runs_the_times_check():
    line = gb.box_line()
    assert line.startswith("python3 -m pip install --no-index --find-links gpu_bundle/wheels 'deepspeed==0.19.8' ")
    assert line.endswith("&& python3 scripts/gpu_check.py --workload times")
    assert all(f"'{t}'" in line for t in gb.TOP) and "--engine" not in line  # hf is picked without vLLM


def test_wheel_name_normalizes():
    assert gb.wheel_name("great_expectations-1.24.1-py3-none-any.whl") == "great-expectations"
    assert gb.wheel_name("ruamel.yaml.clib-0.2.15-cp312-cp312-manylinux2014_x86_64.whl") == "ruamel-yaml-clib"


def test_wheels_the_lock_no_longer_pins_are_removed(tmp_path):
    for name in ("scipy-1.17.1-cp312-cp312-manylinux_2_28_x86_64.whl", "prefect-3.7.7-py3-none-any.whl",
                 "pandas-3.0.0-cp312-cp312-manylinux_2_28_x86_64.whl"):
        (tmp_path / name).write_bytes(b"x")
    dropped = gb.drop_unlocked([("prefect", "3.7.7"), ("pandas", "3.1.1")], tmp_path)
    assert dropped == ["pandas-3.0.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                       "scipy-1.17.1-cp312-cp312-manylinux_2_28_x86_64.whl"]
    assert [p.name for p in tmp_path.iterdir()] == ["prefect-3.7.7-py3-none-any.whl"]
