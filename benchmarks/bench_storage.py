"""Storage throughput on local disk and on S3 (a moto server this script starts and stops).

    python -m benchmarks.bench_storage [--repeats 3] [--rows 4096] [--tokens 512] [--params 100000000]

Prints MB/s (1 MB = 1e6 bytes of in-memory data: Arrow buffers for tables, tensor bytes for
checkpoints), the median of `--repeats` runs, for writing and reading:
- rollout data: rows x tokens of prompt_ids/response_ids (list<int32>) and rollout_logprobs
  (list<float32>) through write_table/read_table (sha256-verified reads);
- a float32 checkpoint of random tensors through save_checkpoint/load_state_dict.
A benchmark, not a test: it asserts only that what it reads equals what it wrote.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from typing import Callable

import numpy as np
import pyarrow as pa

from storage import join, load_state_dict, read_table, save_checkpoint, url_to_fs, write_table
from tests.servers import MotoServer


def rollout_table(rows: int, tokens: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)

    def lists(values: np.ndarray) -> pa.Array:
        offsets = pa.array(np.arange(0, rows * tokens + 1, tokens, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))

    return pa.table({
        "prompt_ids": lists(rng.integers(0, 32000, (rows, tokens), dtype=np.int32)),
        "response_ids": lists(rng.integers(0, 32000, (rows, tokens), dtype=np.int32)),
        "rollout_logprobs": lists(-rng.random((rows, tokens), dtype=np.float32)),
    })


def random_state_dict(n_params: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    # 4096x4096 blocks (16.8M params, 67 MB) like transformer matrices, plus a remainder.
    block = 4096 * 4096
    sd = {f"layers.{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(n_params // block)}
    if n_params % block:
        sd["tail.weight"] = torch.randn(n_params % block, generator=g)
    return sd


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_table(root: str, storage, table: pa.Table, repeats: int) -> tuple[float, float]:
    writes, reads = [], []
    for _ in range(repeats):
        dest = join(root, f"table-{uuid.uuid4().hex[:8]}")
        t_write, uri = timed(lambda: write_table(dest, table, storage=storage))
        t_read, back = timed(lambda: read_table(uri, storage=storage))
        assert back.equals(table)
        writes.append(t_write)
        reads.append(t_read)
        _remove(dest, storage)
    mb = table.nbytes / 1e6
    return mb / statistics.median(writes), mb / statistics.median(reads)


def bench_checkpoint(root: str, storage, sd: dict, repeats: int) -> tuple[float, float]:
    import torch

    writes, reads = [], []
    for _ in range(repeats):
        dest = join(root, f"ckpt-{uuid.uuid4().hex[:8]}")
        t_write, _ = timed(lambda: save_checkpoint(dest, sd, config={"model_type": "bench"}, storage=storage))
        t_read, back = timed(lambda: load_state_dict(dest, storage=storage))
        assert all(torch.equal(back[k], v) for k, v in sd.items())
        del back
        writes.append(t_write)
        reads.append(t_read)
        _remove(dest, storage)  # keeps moto's memory (it holds objects in RAM) bounded
    mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    return mb / statistics.median(writes), mb / statistics.median(reads)


def _remove(url: str, storage) -> None:
    fs, path = url_to_fs(url, storage)
    fs.rm(path, recursive=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--params", type=int, default=100_000_000)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # 2 shared cores; serialisation is single-threaded anyway
    table = rollout_table(args.rows, args.tokens)
    sd = random_state_dict(args.params)
    table_mb = table.nbytes / 1e6
    ckpt_mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlmill-bench-") as tmp, MotoServer() as s3:
        for backend, root, storage in (("local", tmp, None), ("s3 (moto)", s3.new_bucket(), s3.config())):
            w, r = bench_table(root, storage, table, args.repeats)
            rows.append((backend, f"rollout {args.rows}x{args.tokens} ({table_mb:.0f} MB)", w, r))
            w, r = bench_checkpoint(root, storage, sd, args.repeats)
            rows.append((backend, f"checkpoint {args.params / 1e6:.0f}M fp32 ({ckpt_mb:.0f} MB)", w, r))
    print(f"median of {args.repeats} repeats, MB/s (1 MB = 1e6 bytes of in-memory data)")
    print(f"{'backend':<10} {'data':<34} {'write MB/s':>11} {'read MB/s':>10}")
    for backend, what, w, r in rows:
        print(f"{backend:<10} {what:<34} {w:>11.1f} {r:>10.1f}")


if __name__ == "__main__":
    main()
