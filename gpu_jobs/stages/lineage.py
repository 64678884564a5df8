"""Where a run's start weights came from: the run and iteration whose checkpoint model.path names.

    model_source("/data/.rlmill/runs/sft-arith/checkpoints/20/policy", storage)
    # {"run_id": "sft-arith", "run_uid": "3f2c...", "iteration": 20, "root": "/data/.rlmill", "kind": "sft"}

A chain of runs (SFT, then RL on the same model) is two runs, the second's model.path the first's
`checkpoints/<k>/policy` folder (RunLayout.policy). Run.open records this in the second run's
run.json as `model_source`, once, when the run is created: a reader of either run sees which
weights the other started from, and the source's run_uid tells a run deleted and started again
under the same id apart from the one that was trained from.
"""

from __future__ import annotations

import re
from typing import Any

from storage import RunLayout

__all__ = ["model_source", "source_kind"]

# <root>/runs/<run_id>/checkpoints/<k>/policy, as RunLayout lays a checkpoint's HF folder out.
_POLICY = re.compile(r"^(?P<root>.+?)/runs/(?P<run_id>[^/]+)/checkpoints/(?P<k>\d+)/policy/?$")


def source_kind(frozen_config: dict[str, Any]) -> str:
    """What a run trained with, from its frozen config: 'sft', 'dpo' / 'kto', or the RL estimator."""
    if frozen_config.get("sft") is not None:
        return "sft"
    if frozen_config.get("preference") is not None:
        return str(frozen_config["preference"].get("algorithm", "dpo"))
    return str(frozen_config.get("algorithm", {}).get("adv_estimator", "rl"))


def model_source(model_path: str, storage: Any = None) -> dict[str, Any] | None:
    """The run checkpoint `model_path` points into, or None for any other model (an alias, an HF
    folder). Its run_uid and kind come from that run's run.json (None when it has none: a folder
    copied out of its run)."""
    m = _POLICY.match(str(model_path).removeprefix("file://"))
    if m is None:
        return None
    root = m["root"]
    frozen = RunLayout(root, m["run_id"], storage).read_run_json()
    return {"run_id": m["run_id"], "run_uid": frozen.get("run_uid") if frozen else None, "iteration": int(m["k"]),
            "root": root, "kind": source_kind(frozen["config"]) if frozen else None}
