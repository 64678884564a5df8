"""Reading DeepSpeed's torch files from storage without running their pickles.

    >>> state = load_weights_only("zero/zero_pp_rank_0_mp_rank_00_optim_states.pt", mmap=True)
    >>> with weights_only_loads():       # DeepSpeed's own torch.load calls, e.g. engine.load_checkpoint
    ...     engine.load_checkpoint(folder, tag=tag)

A checkpoint's files come from object storage, which anyone holding its keys can write: a
manifest's sha256 proves the files are the ones the manifest names, not that the manifest is
ours. `torch.load(weights_only=False)` would run whatever a file's pickle says, so every load
here is `weights_only=True`: tensors, containers and numbers, plus the few plain data classes
DeepSpeed itself pickles into its files (`DEEPSPEED_GLOBALS`, allow-listed with
torch.serialization.add_safe_globals). DeepSpeed's loaders pass `weights_only=False`
themselves; `weights_only_loads()` overrides that for the calls inside it through torch's own
switch (TORCH_FORCE_WEIGHTS_ONLY_LOAD). A file holding anything else is refused by torch's
unpickler, naming the global it met.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import Any, Iterator

__all__ = ["DEEPSPEED_GLOBALS", "load_weights_only", "weights_only_loads"]

# What DeepSpeed 0.19 pickles into model/optimizer states besides tensors and containers
# (found with torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-0..3, one and two
# ranks): the loss scaler(s), the ZeRO stage enum, the fragment addresses of universal states.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_FORCE, _FORCE_NOT = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_LOCK = threading.RLock()
_ALLOWED: list[Any] = []


def _allow_deepspeed() -> None:
    import torch

    with _LOCK:
        if _ALLOWED:
            return
        for dotted in DEEPSPEED_GLOBALS:
            module, _, name = dotted.rpartition(".")
            _ALLOWED.append(getattr(importlib.import_module(module), name))
        torch.serialization.add_safe_globals(_ALLOWED)


def load_weights_only(path: str, **kwargs: Any) -> Any:
    """torch.load(path) onto the CPU with weights_only=True and DeepSpeed's data classes allowed."""
    import torch

    _allow_deepspeed()
    return torch.load(path, map_location="cpu", weights_only=True, **kwargs)


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside (DeepSpeed's included, whatever it passes) loads weights_only."""
    _allow_deepspeed()
    with _LOCK:  # nested or concurrent uses restore the environment as they found it
        saved = {k: os.environ.get(k) for k in (_FORCE, _FORCE_NOT)}
        os.environ[_FORCE] = "1"
        os.environ.pop(_FORCE_NOT, None)  # both set is an error in torch; safety wins here
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
