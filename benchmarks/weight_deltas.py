"""What a delta format would save when a run publishes its weights every step (issue
"Asynchronous RL": the rollout pool loads `checkpoints/<k>/policy` after every update).

    .venv/bin/python -m benchmarks.weight_deltas ROOT RUN_ID        # a run with checkpoint_every=1 (or async)

For each pair of consecutive published policies it prints the bytes published today (the full
safetensors folder) and what three delta encodings of the change would take:

- `sparse bf16`: the elements whose bfloat16 value changed, as (int32 index, bf16 value) pairs,
  6 bytes each: what a bf16 rollout engine needs, lossless for it.
- `xor fp32 + zlib`: the XOR of the old and new float32 words, zlib level 6: lossless for the
  fp32 weights (unchanged words XOR to 0, small updates leave the sign and exponent bits equal).
- `xor bf16 + zlib`: the same on the bf16 words.

Not a test; the numbers depend on the learning rate and the optimizer (Adam moves nearly every
weight a little every step, so fp32 deltas are dense, while most bf16 values do not change).
"""

from __future__ import annotations

import argparse
import zlib
from typing import Any

CODECS = ("sparse bf16", "xor fp32 + zlib", "xor bf16 + zlib")


def _words(t: Any, dtype: Any) -> Any:
    """The tensor's raw bits as integers of the same width (fp32 -> int32, bf16 -> int16)."""
    import torch

    return t.detach().to(dtype).contiguous().view(torch.int32 if dtype == torch.float32 else torch.int16)


def delta_sizes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, int]:
    """Bytes of each encoding in CODECS for the change old -> new (same names and shapes), plus
    'full fp32' (4 bytes per element) and 'elements'."""
    import torch

    if old.keys() != new.keys():
        raise ValueError(f"the two state dicts name different tensors: {sorted(old.keys() ^ new.keys())[:5]}")
    out = dict.fromkeys(CODECS, 0) | {"full fp32": 0, "elements": 0}
    for name, b in new.items():
        a = old[name]
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} -> {tuple(b.shape)}")
        out["elements"] += b.numel()
        out["full fp32"] += 4 * b.numel()
        a16, b16 = _words(a, torch.bfloat16), _words(b, torch.bfloat16)
        out["sparse bf16"] += 6 * int((a16 != b16).sum())
        out["xor fp32 + zlib"] += len(zlib.compress((_words(a, torch.float32) ^ _words(b, torch.float32))
                                                    .numpy().tobytes(), 6))
        out["xor bf16 + zlib"] += len(zlib.compress((a16 ^ b16).numpy().tobytes(), 6))
    return out


def _folder_bytes(url: str) -> int:
    from storage import url_to_fs

    fs, path = url_to_fs(url)
    return sum(info["size"] for info in fs.ls(path, detail=True) if info["type"] == "file")


def main(argv: list[str] | None = None) -> None:
    from storage import INDEX_NAME, RunLayout, join, load_state_dict, url_to_fs

    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_deltas", description=__doc__.split("\n")[0])
    p.add_argument("root")
    p.add_argument("run_id")
    args = p.parse_args(argv)
    lay = RunLayout(args.root, args.run_id)
    fs, _ = url_to_fs(lay.root)
    versions = [k for k in range(1, 10_000) if fs.exists(url_to_fs(join(lay.policy(k), INDEX_NAME))[1])]
    pairs = [(a, b) for a, b in zip(versions, versions[1:]) if b == a + 1]
    if not pairs:
        raise SystemExit(f"{lay.root}: no two consecutive published policies (run with trainer.checkpoint_every=1)")
    print(f"| update | published folder | {' | '.join(CODECS)} | bf16 elements changed |")
    print("|---|---:|" + "---:|" * (len(CODECS) + 1))
    prev = load_state_dict(lay.policy(pairs[0][0]))
    for a, b in pairs:
        cur = load_state_dict(lay.policy(b))
        sizes, full = delta_sizes(prev, cur), _folder_bytes(lay.policy(b))
        cells = [f"{sizes[c] / 1e6:.2f} MB ({sizes[c] / full:.1%})" for c in CODECS]
        changed = sizes["sparse bf16"] / 6 / sizes["elements"]
        print(f"| {a} -> {b} | {full / 1e6:.2f} MB | {' | '.join(cells)} | {changed:.1%} |")
        prev = cur


if __name__ == "__main__":
    main()
