"""Resharding a DeepSpeed trainer checkpoint to another world size or ZeRO stage, Adam state
included: the fp32 weights and each parameter's ``exp_avg``, ``exp_avg_sq`` and ``step`` are
consolidated from the saved shards, then each rank puts its own partition back into the new
engine's optimizer.

    from gpu_jobs.train.reshard import read_full_state, place_full_state
    full = read_full_state(folder + "/zero", trainable_names)   # every rank reads every shard
    place_full_state(trainer, full)                             # every rank keeps its partition

Why not DeepSpeed's universal checkpoint (``ds_to_universal`` + ``load_universal``): in
deepspeed 0.19.8 only the ZeRO-1/2 (and bf16) optimizers load it; a ZeRO-0 fp32 engine (what
``zero_stage: auto`` runs on one rank) has no universal loader, and a ZeRO-0 checkpoint is not a
conversion source. Resuming 2 ranks (ZeRO-3) on 1 rank (ZeRO-0) crosses exactly that line.

Layouts read: ZeRO-0 fp32 (a torch AdamW state_dict beside the module), ZeRO-1/2 (one flat fp32
partition per parameter group and rank, parameters packed end to end with alignment padding) and
ZeRO-3 (each parameter split in ``ceil(numel / world_size)`` pieces, one per rank, the last one
padded). Layouts written into: the same, through DeepSpeed's fragment API
(``safe_set_full_*`` for ZeRO-1/2 and bf16, ``safe_set_local_*`` for ZeRO-3) or the torch
optimizer's state for ZeRO-0 fp32. Anything else (ZeRO-0 bf16's FP16_UnfusedOptimizer, an
optimizer other than torch AdamW, pipeline layouts) raises ``UnsupportedLayout``.

Cost: every rank holds the full fp32 weights and both moments (12 bytes per parameter) while
loading; fine for the models this runs on one node, not for 70B (there, keep the world size).
"""

from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FullState", "UnsupportedLayout", "ADAM_KEYS", "zero3_partition_numel", "merge_zero3",
           "merge_zero12", "zero3_local_slice", "read_full_state", "place_full_state"]

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


class UnsupportedLayout(ValueError):
    """A checkpoint or engine layout this module cannot reshard (the caller falls back)."""


@dataclass
class FullState:
    """A trainer's optimizer state, whole: per trainable parameter (HF name) its fp32 weights,
    Adam moments ``{"exp_avg": t, "exp_avg_sq": t}`` (each shaped like the parameter) and Adam
    step; ``weights`` also holds buffers and tied aliases, as ``load_weights`` takes them;
    ``counters``: DeepSpeed's engine counters (global_steps, global_samples, skipped_steps)."""

    weights: dict[str, Any]
    moments: dict[str, dict[str, Any]]
    steps: dict[str, float]
    counters: dict[str, int] = field(default_factory=dict)
    source: str = ""  # e.g. "ZeRO-3 over 2 ranks", for the log


# ---- layout math (pure) ------------------------------------------------------------------
def zero3_partition_numel(numel: int, world_size: int) -> int:
    """Elements of one ZeRO-3 partition of a ``numel``-element parameter over ``world_size``
    ranks: ``ceil(numel / world_size)``; the last rank's piece is zero-padded to that size."""
    return math.ceil(numel / world_size)


def merge_zero3(flats: list[Any], numels: list[int]) -> list[Any]:
    """Whole flat parameters from ZeRO-3 shards. ``flats``: one 1-D tensor per rank (the rank's
    flat groups concatenated), ``numels``: each parameter's element count in saved order.
    Parameter j sits at the same offset on every rank, ``zero3_partition_numel`` long; the
    pieces in rank order, cut to ``numels[j]``, are the parameter. Returns ``(numels[j],)``
    tensors. Raises ValueError when the shards do not hold exactly those parameters."""
    import torch

    world_size, offset, out = len(flats), 0, []
    for numel in numels:
        part = zero3_partition_numel(numel, world_size)
        out.append(torch.cat([f[offset:offset + part] for f in flats])[:numel])
        offset += part
    if any(f.numel() != offset for f in flats):
        raise ValueError(f"ZeRO-3 shards hold {[f.numel() for f in flats]} elements per rank, the "
                         f"saved parameters need {offset}: the checkpoint's files do not belong together")
    return out


def merge_zero12(flats: list[Any], numels: list[int], paddings: list[int] | None) -> list[Any]:
    """Whole flat parameters from one ZeRO-1/2 parameter group. ``flats``: each rank's flat
    partition; concatenated in rank order they are the group's parameters end to end, parameter
    j followed by ``paddings[j]`` alignment elements, the whole padded to a multiple of
    ``2 * world_size``. Returns ``(numels[j],)`` views. Raises ValueError on a size mismatch."""
    import torch

    whole = torch.cat(list(flats))
    paddings = paddings or [0] * len(numels)
    if len(paddings) != len(numels):
        raise ValueError(f"{len(paddings)} alignment paddings for {len(numels)} parameters")
    needed = sum(numels) + sum(paddings)
    align = 2 * len(flats)  # DeepSpeed pads each group to 2 * world_size (see zero_to_fp32)
    if align * math.ceil(needed / align) != align * math.ceil(whole.numel() / align):
        raise ValueError(f"ZeRO-1/2 group of {whole.numel()} elements, parameters need {needed}: the "
                         "checkpoint's files do not belong together")
    out, offset = [], 0
    for numel, pad in zip(numels, paddings):
        out.append(whole.narrow(0, offset, numel))
        offset += numel + pad
    return out


def zero3_local_slice(full: Any, rank: int, world_size: int) -> Any:
    """This rank's ZeRO-3 piece of a whole parameter (any shape): the flat tensor zero-padded to
    ``world_size * zero3_partition_numel`` and cut in ``world_size`` equal parts."""
    import torch.nn.functional as F

    flat = full.reshape(-1)
    part = zero3_partition_numel(flat.numel(), world_size)
    padded = F.pad(flat, (0, part * world_size - flat.numel()))
    return padded.narrow(0, rank * part, part)


# ---- reading a saved checkpoint ----------------------------------------------------------
def _rank_of(path: str) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))


def _load(path: str) -> dict[str, Any]:
    from .safe_load import load_weights_only

    # mmap: only the slices the merge touches are read; weights_only with DeepSpeed's own enums
    # and loss scaler allowed: the files come from storage, and a sha256 proves no authorship.
    return load_weights_only(path, mmap=True)


def read_full_state(ckpt_dir: str, trainable: dict[str, list[int]]) -> FullState:
    """The whole state in DeepSpeed's ``save_checkpoint`` folder ``ckpt_dir`` (``<folder>/<tag>``).
    ``trainable``: name -> shape of the parameters the optimizer holds, in model order (a ZeRO-0
    state_dict knows them only by position). Raises UnsupportedLayout for a layout it cannot
    read, ValueError for files that do not fit together."""
    optim_files = sorted(glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_optim_states.pt")), key=_rank_of)
    if not optim_files:
        return _read_zero0(os.path.join(ckpt_dir, "mp_rank_00_model_states.pt"), trainable)
    if [_rank_of(f) for f in optim_files] != list(range(len(optim_files))):
        raise ValueError(f"ZeRO optimizer shards of ranks {[_rank_of(f) for f in optim_files]} in {ckpt_dir}")
    model_files = sorted(glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_model_states.pt")), key=_rank_of)
    model_file = model_files[0] if model_files else os.path.join(ckpt_dir, "mp_rank_00_model_states.pt")
    model = _load(model_file)
    shards = [_load(f)["optimizer_state_dict"] for f in optim_files]
    stage = int(shards[0]["zero_stage"])
    shapes = {n: list(s) for g in model["param_shapes"] for n, s in g.items()}
    groups = [[(n, math.prod(s)) for n, s in g.items()] for g in model["param_shapes"]]
    weights, moments, steps = (_read_zero3 if stage == 3 else _read_zero12)(shards, groups)
    weights = {n: w.reshape(shapes[n]) for n, w in weights.items()}
    moments = {n: {k: v.reshape(shapes[n]) for k, v in m.items()} for n, m in moments.items()}
    buffers = {k: v.float() if v.is_floating_point() else v
               for k, v in model["module"].items() if k in set(model.get("buffer_names") or [])}
    for alias, target in (model.get("shared_params") or {}).items():
        if target in weights:
            weights[alias] = weights[target]
    return FullState({**buffers, **weights}, moments, steps, _counters(model),
                     f"ZeRO-{stage} over {len(shards)} rank(s)")


def _counters(model_states: dict[str, Any]) -> dict[str, int]:
    return {k: int(model_states[k]) for k in _COUNTERS if model_states.get(k) is not None}


def _adam_states(base: dict[str, Any], n: int, where: str) -> list[dict[str, Any]]:
    """The ``n`` per-group Adam states of a torch optimizer state_dict, checked for our keys."""
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict) or sorted(state) != list(range(n)):
        raise UnsupportedLayout(f"{where}: optimizer state is not one torch Adam state per group")
    for s in state.values():
        missing = [k for k in (*ADAM_KEYS, "step") if k not in s]
        if missing or "max_exp_avg_sq" in s:
            raise UnsupportedLayout(f"{where}: not a plain AdamW state (missing {missing}, or amsgrad)")
    return [state[i] for i in range(n)]


def _read_zero3(shards: list[dict], groups: list[list[tuple[str, int]]]):
    import torch

    n_sub = len(shards[0]["fp32_flat_groups"])
    states = [_adam_states(s["optimizer_state_dict"], n_sub, "ZeRO-3 shard") for s in shards]
    names = [n for g in groups for n, _ in g]
    numels = [k for g in groups for _, k in g]
    step_values = {float(s["step"]) for rank in states for s in rank}
    if len(step_values) != 1:  # one step for all sub-groups: parameters cannot carry their own
        raise UnsupportedLayout(f"ZeRO-3 sub-groups at different Adam steps {sorted(step_values)}")

    def whole(of) -> dict[str, Any]:
        flats = [torch.cat([of(r, i) for i in range(n_sub)]) for r in range(len(shards))]
        return dict(zip(names, merge_zero3(flats, numels)))

    weights = whole(lambda r, i: shards[r]["fp32_flat_groups"][i])
    per_key = {k: whole(lambda r, i, k=k: states[r][i][k]) for k in ADAM_KEYS}
    moments = {n: {k: per_key[k][n] for k in ADAM_KEYS} for n in names}
    return weights, moments, dict.fromkeys(names, step_values.pop())


def _read_zero12(shards: list[dict], groups: list[list[tuple[str, int]]]):
    if "single_partition_of_fp32_groups" not in shards[0]:
        raise UnsupportedLayout("ZeRO-1/2 shard without single_partition_of_fp32_groups")
    states = [_adam_states(s["base_optimizer_state"], len(groups), "ZeRO-1/2 shard") for s in shards]
    paddings = shards[0].get("param_alignment_paddings") or [None] * len(groups)
    weights, moments, steps = {}, {}, {}
    for g, params in enumerate(groups):
        names, numels = [n for n, _ in params], [k for _, k in params]

        def whole(flats, g=g) -> list[Any]:
            return merge_zero12(flats, numels, paddings[g])

        weights.update(zip(names, whole([s["single_partition_of_fp32_groups"][g] for s in shards])))
        per_key = {k: whole([st[g][k] for st in states]) for k in ADAM_KEYS}
        for j, n in enumerate(names):
            moments[n] = {k: per_key[k][j] for k in ADAM_KEYS}
            steps[n] = float(states[0][g]["step"])
    return weights, moments, steps


def _read_zero0(path: str, trainable: dict[str, list[int]]) -> FullState:
    """ZeRO-0 fp32: the module's state_dict and the torch AdamW state_dict, whose integer keys
    are positions in the optimizer's parameter list (the trainable parameters in model order)."""
    sd = _load(path)
    opt = sd.get("optimizer")
    if not isinstance(opt, dict) or "fp32_groups" in opt or "param_groups" not in opt:
        raise UnsupportedLayout(f"{os.path.basename(path)}: not a torch AdamW state (ZeRO-0 bf16 "
                                "keeps its fp32 master weights in DeepSpeed's FP16_UnfusedOptimizer)")
    order = [i for g in opt["param_groups"] for i in g["params"]]
    names = list(trainable)
    if len(order) != len(names):
        raise ValueError(f"{path}: the optimizer holds {len(order)} parameters, the model trains {len(names)}")
    moments, steps = {}, {}
    for name, i in zip(names, order):
        s = opt["state"].get(i)
        if s is None:  # never had a gradient: torch AdamW has not started it
            continue
        if any(list(s[k].shape) != list(trainable[name]) for k in ADAM_KEYS):
            raise ValueError(f"{path}: optimizer entry {i} has shape {list(s['exp_avg'].shape)}, {name} is {trainable[name]}")
        moments[name] = {k: s[k] for k in ADAM_KEYS}
        steps[name] = float(s["step"])
    weights = {k: v.float() if v.is_floating_point() else v for k, v in sd["module"].items()}
    return FullState(weights, moments, steps, _counters(sd), "ZeRO-0 on 1 rank")


# ---- placing it into a live engine --------------------------------------------------------
def _base_optimizer(engine: Any) -> Any:
    """The torch AdamW doing the arithmetic: inside DeepSpeed's ZeRO wrapper, or the engine's own."""
    import torch

    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    if type(base) is not torch.optim.AdamW or any(g.get("amsgrad") for g in base.param_groups):
        raise UnsupportedLayout(f"the engine's optimizer is {type(base).__name__}, not torch AdamW "
                                "without amsgrad: its state cannot be rebuilt here")
    return base


def _optimized_tensors(engine: Any, base: Any) -> list[tuple[Any, dict[str, Any]]]:
    """(tensor, its param group) for each tensor ``base`` steps. ZeRO-3 puts its fp32 flat
    partitions into the param groups only for the length of a step, so they are read from it."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        return [(f, base.param_groups[0]) for f in flats]
    return [(p, group) for group in base.param_groups for p in group["params"]]


def _start_adam_state(engine: Any, base: Any, step: float) -> None:
    """Give every tensor ``base`` steps an Adam state at ``step`` with zero moments, as torch's
    AdamW would create on its first step (DeepSpeed's optimizers create theirs lazily, so a
    fresh engine has none to copy into). Existing states get the step only."""
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    for p, group in _optimized_tensors(engine, base):
        on_device = bool(group.get("capturable") or group.get("fused"))
        state = base.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # torch keeps step as a float tensor, on the host unless capturable/fused.
        state["step"] = torch.tensor(step, dtype=_get_scalar_dtype(), device=p.device if on_device else "cpu")


def _one_step(full: FullState, names: list[str]) -> float:
    """The Adam step every flat group gets. Steps differ only for a parameter that never had a
    gradient in a ZeRO-0 run (no state: step 0); it takes the others' step with zero moments,
    which is what its update would be had it joined late."""
    steps = {full.steps.get(n, 0.0) for n in names}
    return max(steps) if steps else 0.0


def _layout(engine: Any, first_param: Any) -> str:
    """How this engine keeps its fp32 master weights and Adam state: "zero3" (a local piece per
    parameter), "fragments" (ZeRO-1/2, bf16: flat partitions linked to parameters) or "torch"
    (ZeRO-0 fp32: torch's per-parameter state). Raises UnsupportedLayout before anything changes."""
    base = _base_optimizer(engine)
    if hasattr(first_param, "ds_id"):
        return "zero3"
    if hasattr(first_param, "_hp_mapping"):
        if not hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
            raise UnsupportedLayout(f"{type(engine.optimizer).__name__} links no optimizer state to parameters")
        return "fragments"
    if base is engine.optimizer:
        return "torch"
    raise UnsupportedLayout(f"no way to place optimizer state into {type(engine.optimizer).__name__}")


def place_full_state(module: Any, full: FullState) -> None:
    """Put ``full`` into ``module`` (a ZeroModule): weights everywhere, then the fp32 master
    weights and Adam moments of this rank's partition, the Adam step and the engine counters.
    All ranks call it with the same ``full``. UnsupportedLayout is raised before any change."""
    engine = module.engine
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    missing = [n for n, _ in params if n not in full.weights]
    if missing:
        raise UnsupportedLayout(f"the checkpoint lacks trained parameters {missing[:3]}")
    layout = _layout(engine, params[0][1])
    # Model weights first (load_weights also refreshes a ZeRO-1/2 optimizer's flat fp32 copy from
    # them). Buffers are not parameters: load_weights refuses them.
    module.load_weights({k: v for k, v in full.weights.items() if k in module._param_shapes or k in module._aliases})
    base = _base_optimizer(engine)
    _start_adam_state(engine, base, _one_step(full, [n for n, _ in params]))
    if layout == "zero3":
        _place_zero3(module, params, full)
    elif layout == "fragments":
        _place_fragments(engine, params, full)
    else:
        _place_torch(base, params, full)
    for key, value in full.counters.items():
        setattr(engine, key, value)


def _moment(full: FullState, name: str, key: str, like: Any) -> Any:
    """``full``'s moment ``key`` of ``name``; zeros for a parameter that had no Adam state yet."""
    import torch

    m = full.moments.get(name)
    return m[key] if m is not None else torch.zeros(like.shape, dtype=torch.float32)


def _place_zero3(module: Any, params: list[tuple[str, Any]], full: FullState) -> None:
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    # Not safe_set_full_*: in deepspeed 0.19.8 it cuts the unpadded tensor, which overruns on the
    # last rank whenever numel is not a multiple of world_size.
    rank, world_size = module.rank, module.world_size
    for name, p in params:
        w = full.weights[name]
        safe_set_local_fp32_param(p, zero3_local_slice(w.float(), rank, world_size))
        for k in ADAM_KEYS:
            safe_set_local_optimizer_state(p, zero3_local_slice(_moment(full, name, k, w), rank, world_size), k)


def _place_fragments(engine: Any, params: list[tuple[str, Any]], full: FullState) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    engine.optimizer._lazy_init_hp_params_optimizer_state()  # link fragments to the new states
    for name, p in params:  # a parameter outside this rank's partition is skipped by DeepSpeed
        w = full.weights[name]
        safe_set_full_fp32_param(p, w.float())
        for k in ADAM_KEYS:
            safe_set_full_optimizer_state(p, _moment(full, name, k, w), k)


def _place_torch(base: Any, params: list[tuple[str, Any]], full: FullState) -> None:
    import torch

    with torch.no_grad():
        for name, p in params:
            for k in ADAM_KEYS:
                base.state[p][k].copy_(_moment(full, name, k, p).reshape(p.shape))
            base.state[p]["step"].fill_(full.steps.get(name, 0.0))
