"""`benchmarks/bench_rollout.py`'s argument handling, prompts and table; one tiny real run of every
backend on the built-in model (e2e).

    .venv/bin/python -m pytest -q tests/bench/test_bench_rollout.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_rollout as br

torch.set_num_threads(1)  # 2 cores shared with other jobs


def test_grid_and_lengths_make_every_cell_in_order():
    args = br.parse_args(["--model", "smollm2", "--grid", "8x4,16x4", "--tokens", "32,64"])
    assert args.cells_list == [(8, 4, 32), (16, 4, 32), (8, 4, 64), (16, 4, 64)]
    # no --grid: one cell from --prompts x --samples, the old default workload
    assert br.parse_args([]).cells_list == [(64, 4, 128)]
    assert br.parse_args(["--prompts", "2", "--samples", "3", "--tokens", "5"]).cells_list == [(2, 3, 5)]
    assert br._parse_cells_arg(br._cells_arg([(8, 4, 32), (16, 2, 64)])) == [(8, 4, 32), (16, 2, 64)]


@pytest.mark.parametrize("argv, message", [
    (["--grid", "8by4"], "not PROMPTSxSAMPLES"),
    (["--grid", "0x4"], "positive"),
    (["--tokens", "0"], "lengths must be >= 1"),
    (["--model", "7b"], "unknown --model"),
    (["--backends", "sglang"], "unknown --backends"),
    (["--dtype", "float16"], "unknown --dtype"),
])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        br.parse_args(argv)
    assert message in capsys.readouterr().err


def test_table_rows_per_cell_with_ratios_from_the_same_run():
    cells = lambda rate: [{"prompts": 8, "samples": 4, "max_tokens": 32, "tokens_per_s": rate},  # noqa: E731
                          {"prompts": 32, "samples": 4, "max_tokens": 32, "tokens_per_s": 2 * rate}]
    text = br.table({"smollm2": {"generate": cells(100.0), "hf": cells(125.0), "vllm": cells(250.0)}})
    rows = text.splitlines()
    assert rows[0].startswith("| model | prompts x samples | max tokens | generate tok/s (median)")
    assert rows[2] == "| smollm2 | 8x4 | 32 | 100 | 125 | 250 | 1.25x | 2.50x | 2.00x |"
    assert rows[3] == "| smollm2 | 32x4 | 32 | 200 | 250 | 500 | 1.25x | 2.50x | 2.00x |"
    # best: the fastest repeat where the cell has one
    fast = {"generate": [{**cells(100.0)[0], "best_tokens_per_s": 150.0}], "hf": cells(125.0)[:1]}
    assert "| m | 8x4 | 32 | 150 | 125 | - | 0.83x | n/a | n/a |" in br.table({"m": fast}, "best")
    # a failed backend shows its error and leaves its columns empty; ratios need both sides
    text = br.table({"m": {"generate": cells(100.0), "vllm": {"error": "boom"}}})
    assert "vllm failed: 'boom'" in text
    assert "| m | 8x4 | 32 | 100 | - | - | n/a | n/a | n/a |" in text


def test_prompts_use_the_models_chat_template_and_keep_the_builtin_prompts():
    from transformers import AutoTokenizer

    from gpu_jobs.models import ensure_builtin_model

    tok = AutoTokenizer.from_pretrained(ensure_builtin_model())
    assert br._prompts(3, tok) == br._prompts(3, None)  # the built-in template passes the text through


@pytest.mark.e2e
def test_every_backend_generates_exactly_the_forced_tokens(tmp_path):
    from gpu_jobs.models import ensure_builtin_model

    path = ensure_builtin_model()
    for backend in br.BACKENDS:
        rows = br.measure_all(backend, path, [(2, 2, 5), (3, 1, 4)], repeats=1)
        assert [(r["prompts"], r["samples"], r["max_tokens"], r["tokens"]) for r in rows] == \
            [(2, 2, 5, 20), (3, 1, 4, 12)], backend
        assert all(r["tokens_per_s"] > 0 for r in rows)
