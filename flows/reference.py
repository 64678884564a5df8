"""The docs site's generated reference pages, rendered from the code that defines what they list:
every config key (from the typed config classes), every `rlmill serve` flag (from the CLI
parser), the canary test's keys, the verl key aliases, and the metric names the run logs.
scripts/docs_hooks.py adds the two pages to the mkdocs build, so the site shows the current code.

    >>> from flows.reference import config_reference, metrics_reference
    >>> "| `rollout.n` | `int` | `8` |" in config_reference()
    True
    >>> "`actor/pg_loss`" in metrics_reference()
    True

A config field without help text is an error (MissingHelp, naming every such key), not an empty
cell: the page is where users read what a key does.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["MissingHelp", "config_reference", "metrics_reference", "leaf_keys", "field_at", "metric_names",
           "METRIC_NAMESPACES"]


class MissingHelp(ValueError):
    """Config keys whose field has no help text; the message names each."""


# ----------------------------------------------------------------------------------- cells
def _cell(text: str) -> str:
    """Help text as one table cell: on one line, '|' escaped (it would end the cell), and outside
    `code` '<' and '*' escaped, which markdown would read as an HTML tag ('<text>') or emphasis.

    >>> _cell("answer '<text>' | B*A `<key>`")
    "answer '&lt;text>' \\\\| B\\\\*A `<key>`"
    """
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace("*", "\\*") for i, p in enumerate(parts))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def type_text(tp: Any) -> str:
    """A readable type: `int`, `str, optional`, `one of 'a', 'b'`, `list[str]`.

    >>> type_text(typing.Optional[typing.Literal["a", 1]]), type_text(dict[str, typing.Any])
    ("one of 'a', 1, optional", 'dict[str, any]')
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        parts = " or ".join(type_text(a) for a in args if a is not type(None))
        return parts + (", optional" if type(None) in args else "")
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_text(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if tp is typing.Any:
        return "any"
    if getattr(tp, "__name__", "") == "SecretStr":
        return "str (secret: masked in run.json)"
    return getattr(tp, "__name__", str(tp))


def _default_text(value: Any) -> str:
    if value is inspect.Parameter.empty or type(value).__name__ == "PydanticUndefinedType":
        return "required"
    try:
        return json.dumps(value)  # as YAML/`rlmill config show` would read it back: null, true, "hf"
    except TypeError:
        return repr(value)


# ------------------------------------------------------------------------------- run config
def leaf_keys() -> list[str]:
    """Every key a user sets with `rlmill train key=value`: the leaves of the walk that `rlmill
    config show`'s unknown-key check uses (gpu_jobs.stages.config.config_keys), sections left out.

    >>> "rollout.n" in leaf_keys() and "rollout" not in leaf_keys()
    True
    """
    from gpu_jobs.stages.config import config_keys

    keys = config_keys()
    sections = {k.rpartition(".")[0] for k in keys}
    return [k for k in keys if k not in sections]


def field_at(key: str) -> tuple[type, str, Any]:
    """(owning class, field name, pydantic FieldInfo) of a dotted run-config key.

    >>> field_at("rollout.n")[0].__name__
    'RolloutStageConfig'
    """
    from gpu_jobs.stages.config import RunConfig, _submodels

    owner: type = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        name, info = next((n, f) for n, f in owner.model_fields.items() if (f.alias or n) == part)
        if i == len(parts) - 1:
            return owner, name, info
        owner = _submodels(info.annotation)[0]
    raise KeyError(key)


def _registries(fn: Callable, depth: int = 2) -> list[Any]:
    """The registries (gpu_jobs.registry.Registry) a validator looks names up in: the names its code
    uses, found in its module, in modules it imports inside itself, or (depth) in functions it calls."""
    from gpu_jobs.registry import Registry

    fn = getattr(fn, "__func__", fn)
    code = fn.__code__
    spaces = [fn.__globals__] + [vars(sys.modules[n]) for n in code.co_names if n in sys.modules]
    found: list[Any] = []
    for name in code.co_names:
        obj = next((ns[name] for ns in spaces if name in ns), None)
        if isinstance(obj, Registry):
            found.append(obj)
        elif depth and inspect.isfunction(obj):
            found += _registries(obj, depth - 1)
    return list({id(r): r for r in found}.values())


def registry_choices(owner: type, name: str) -> str:
    """'registered <kind>: a, b' for a field whose validator checks names against a registry, else ''.

    >>> from gpu_jobs.algos.config import AlgorithmConfig
    >>> "grpo" in registry_choices(AlgorithmConfig, "adv_estimator")
    True
    """
    found = []
    for dec in owner.__pydantic_decorators__.field_validators.values():
        if name in dec.info.fields:
            found += [f"registered {r.kind}: " + ", ".join(sorted(r)) for r in _registries(dec.func)]
    return "; ".join(dict.fromkeys(found))


def _default_at(cfg: Any, key: str) -> Any:
    """The value `rlmill config show` shows for `key` with no config and no overrides; a key in a
    section that is off by default (critic, preference) shows its class default."""
    from pydantic_core import to_jsonable_python

    node = cfg
    for part in key.split("."):
        if node is None:
            return field_at(key)[2].get_default(call_default_factory=True)
        node = getattr(node, next(n for n, f in type(node).model_fields.items() if (f.alias or n) == part))
    return to_jsonable_python(node)


def _config_row(key: str, cfg: Any) -> tuple[str, ...]:
    owner, name, info = field_at(key)
    choices = registry_choices(owner, name)
    return (f"`{key}`", f"`{type_text(info.annotation)}`" + (f" ({choices})" if choices else ""),
            f"`{_default_text(_default_at(cfg, key))}`", info.description or "")


def _missing_help(keys: list[str]) -> None:
    missing = [k for k in keys if not (field_at(k)[2].description or "").strip()]
    if missing:
        raise MissingHelp(f"config key(s) without help text: {', '.join(missing)}; give each field a "
                          "description= in its config class")


def _run_config_sections() -> list[str]:
    from gpu_jobs.stages.config import RunConfig, build_run_config

    keys = leaf_keys()
    _missing_help(keys)
    # Defaults as a run gets them: validators fill some in (algorithm.adv_estimator=grpo, the
    # trainer's temperature), so the field's own default is not always what runs.
    cfg = build_run_config({}, check_files=False)
    out = ["## Run config (`rlmill train key=value`)", "",
           f"{len(keys)} keys. Set them in the YAML config file or on the command line as dotted "
           "overrides (`rlmill train --config FILE rollout.n=8`); `rlmill config show` prints them all "
           "with the values a run would use.", ""]
    top = [k for k in keys if "." not in k]
    out += ["### Top level", ""] + _table(("key", "type", "default", "help"), [_config_row(k, cfg) for k in top]) + [""]
    for name, info in RunConfig.model_fields.items():
        section = [k for k in keys if k.startswith(f"{info.alias or name}.")]
        if not section:
            continue
        off = info.default is None and info.default_factory is None
        note = (f" Off by default (`{name}: null`); `{name}: {{}}` or any `{name}.*` key turns it on."
                if off and "turns it on" not in (info.description or "") else "")
        out += [f"### `{name}`", "", _cell(info.description or "") + note, ""]
        out += _table(("key", "type", "default", "help"), [_config_row(k, cfg) for k in section]) + [""]
    return out


# ----------------------------------------------------------------------------- verl aliases
def _verl_section() -> list[str]:
    from flows.verl_keys import VERL_KEYS, VERL_SECTIONS

    rows = []
    for key in sorted(VERL_KEYS):
        rule = VERL_KEYS[key]
        kind = "rejected" if rule.refused or rule.doc.startswith("rejected") else \
            "sets " + ", ".join(f"`{t}`" for t in rule.targets) if rule.targets else "accepted"
        meaning = rule.doc.split(": ", 1)[1] if rule.doc.startswith(("accepted: ", "rejected: ")) else rule.doc
        rows.append((f"`{key}`", kind, meaning))
    return ["## verl keys (aliases)", "",
            f"{len(rows)} verl keys are understood (flows/verl_keys.py), translated to the rlmill keys above. "
            "Keys already rlmill's (`data.*`, `algorithm.*`, ...) pass through unchanged; any other key under "
            f"{', '.join(f'`{s}`' for s in VERL_SECTIONS)} is rejected: no equivalent in rlmill.", ""] \
        + _table(("verl key", "what it does", "meaning here"), rows) + [""]


# ------------------------------------------------------------------ serve flags, canary test
def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _flag_sections(command: tuple[str, ...]) -> list[str]:
    """One table per argument group of `rlmill <command>`, from the parser the CLI itself runs. A
    flag without help text gets an empty cell ('-'): flags are not config fields (MissingHelp)."""
    from flows.cli import build_parser

    parser, out = _subparser(build_parser(), *command), []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            flag = max(action.option_strings, key=len)
            kind = "flag" if action.nargs == 0 else getattr(action.type, "__name__", "str")
            kind = "one of " + ", ".join(map(repr, action.choices)) if action.choices else kind
            default = "required" if action.required else _default_text(action.default)
            rows.append((f"`{flag}`", f"`{kind}`", f"`{default}`", action.help or "-"))
        if rows:
            title = "" if group.title in ("options", "optional arguments") else f": {group.title}"
            out += [f"### `rlmill {' '.join(command)}`{title}", ""]
            out += _table(("flag", "type", "default", "help"), rows) + [""]
    return out


def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment (the one on its line, else the comment lines right above it): how
    the plain dataclasses document their fields."""
    source = inspect.getsource(cls)
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines, out = source.splitlines(), {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, n = [], node.lineno - 1
            while n in by_line and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, by_line[n])
                n -= 1
            out[node.target.id] = by_line.get(node.lineno) or " ".join(above)
    return out


def dataclass_rows(cls: type, key: Callable[[str], str], defaults: dict[str, Any] | None = None) \
        -> list[tuple[str, ...]]:
    """Rows of a dataclass's fields: help from `metadata["help"]`, else the field's comment;
    `defaults` overrides the class's (a value the caller supplies)."""
    comments, rows, missing = _comments(cls), [], []
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or comments.get(f.name, "")
        missing += [] if text else [key(f.name)]
        default = f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
        default = (defaults or {}).get(f.name, default)
        rows.append((f"`{key(f.name)}`", f"`{type_text(typing.get_type_hints(cls)[f.name])}`",
                     f"`{_default_text(default)}`", text))
    if missing:
        raise MissingHelp(f"{cls.__name__} field(s) without help text: {', '.join(missing)}")
    return rows


def _online_sections() -> list[str]:
    from flows.nightly import CanaryPolicy, rl_nightly  # the class the flows' canary_share/canary_test build

    out = ["## Serving and the online loop", "",
           "The flags of `rlmill serve` and `rlmill feedback consume`, as `--help` shows them; the limits "
           "group is generated from ServeLimits, its one declaration.", ""]
    out += _flag_sections(("serve",)) + _flag_sections(("feedback", "consume"))
    share = inspect.signature(rl_nightly.fn).parameters["canary_share"].default  # 0: no canary
    rows = dataclass_rows(CanaryPolicy, lambda n: "canary_share" if n == "share" else f"canary_test.{n}",
                          {"share": share})
    out += ["### Canary (`canary_share`, `canary_test`)", "",
            "Parameters of the rl-retrain and rl-nightly flows: `canary_share` > 0 starts a canary of a "
            "candidate that passed the gate; `canary_test` is a mapping of the other keys (CanaryPolicy).", ""]
    return out + _table(("key", "type", "default", "help"), rows) + [""]


def config_reference() -> str:
    """The config reference page (markdown): run config keys by section, verl aliases, serve flags
    and canary keys. Raises MissingHelp naming every key without help text."""
    head = ["# Config reference", "",
            "Generated from the typed config classes at docs build time (flows/reference.py): every key "
            "with its type, default and help text. Edit the class, not this page.", ""]
    return "\n".join(head + _run_config_sections() + _verl_section() + _online_sections())


# ---------------------------------------------------------------------------------- metrics
# Namespaces of the verl-style metric names (not the names: those come from the source). Other
# namespaced strings in the code are data sources ("openai/gsm8k") or paths.
METRIC_NAMESPACES = ("actor", "critic", "timing_s", "perf", "training", "val", "reward", "rewards", "logps",
                     "response_length", "filter_groups", "rollout_corr", "multi_turn", "async", "gate", "data",
                     "preference", "train", "sft")
_NAME = re.compile(rf"^(?:{'|'.join(METRIC_NAMESPACES)})/[\w@{{}}./-]*[\w}}]$")


def _text_of(node: ast.AST) -> str | None:
    """A string constant, or an f-string as a pattern (`training/rollout_{name}_diff_mean`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    return None


def _prefix_helpers(tree: ast.Module) -> dict[str, list[str]]:
    """Functions `f(prefix, ...)` that return f"{prefix}/mean"-style names: name -> suffixes."""
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.args.args and fn.args.args[0].arg == "prefix":
            suffixes = [(_text_of(n) or "").removeprefix("{prefix}") for n in ast.walk(fn)
                        if isinstance(n, ast.JoinedStr)]
            out[fn.name] = [s for s in suffixes if s.startswith("/")]
    return out


def _module_metrics(tree: ast.Module) -> Iterator[str]:
    helpers, expanded = _prefix_helpers(tree), set()
    # An f-string's literal parts ("training/rollout_") are not names on their own: the f-string is.
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and helpers.get(node.func.id) \
                and node.args and _text_of(node.args[0]):
            expanded.add(id(node.args[0]))
            yield from (_text_of(node.args[0]) + s for s in helpers[node.func.id])
    for node in ast.walk(tree):
        text = _text_of(node) if id(node) not in expanded | parts else None
        if text and _NAME.match(text):
            yield text


def metric_names(packages: tuple[str, ...] = ("gpu_jobs", "flows")) -> dict[str, set[str]]:
    """Metric name (or f-string pattern) -> the modules whose source names it, found with `ast`.

    >>> "gpu_jobs.algos.policy_losses" in metric_names()["actor/pg_loss"]
    True
    """
    import importlib

    found: dict[str, set[str]] = defaultdict(set)
    for package in packages:
        base = Path(importlib.import_module(package).__file__).parent
        for path in sorted(base.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            module = ".".join((package, *path.relative_to(base).with_suffix("").parts)).removesuffix(".__init__")
            for name in _module_metrics(tree):
                found[name].add(module)
    return dict(found)


def _validation_names() -> list[str]:
    # verl's val-core/val-aux names are built from the data source, the variable and N: run the
    # real function on 4 responses to one prompt rather than describe its output by hand.
    from gpu_jobs.reward.val_metrics import validation_metrics

    names = validation_metrics(["<data_source>"] * 4, ["p"] * 4,
                               {"reward": [1.0, 0.0, 1.0, 0.0], "acc": [1, 0, 1, 0], "pred": ["1", "2", "1", "3"]})
    return sorted(names)


def metrics_reference() -> str:
    """The metrics reference page (markdown): every metric name the source emits, by namespace."""
    from flows.reporting import HEADLINE
    from gpu_jobs.reward import val_metrics

    names = metric_names()
    out = ["# Metrics reference", "",
           "Generated at docs build time (flows/reference.py) from the source of gpu_jobs/ and flows/: every "
           "string constant or f-string that is a metric name (`{...}` parts are filled in at run time), and "
           "the `<prefix>/mean|max|min` names of the stats helpers. Names follow verl's. Each iteration's "
           "metrics are in its manifest, the Prefect table artifact, TensorBoard and any tracker.", "",
           "Shown first in each iteration's table artifact: " + ", ".join(f"`{m}`" for m in HEADLINE) + ".", ""]
    by_ns: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        by_ns[name.split("/", 1)[0]].append(name)
    for ns in METRIC_NAMESPACES:
        if by_ns.get(ns):
            rows = [(f"`{n}`", ", ".join(f"`{m}`" for m in sorted(names[n]))) for n in by_ns[ns]]
            out += [f"## `{ns}/`", ""] + _table(("metric", "named in"), rows) + [""]
    doc = val_metrics.__doc__.split("Definitions", 1)[1].split("\n\n", 1)[0]
    out += ["## `val-core/` and `val-aux/`", "", _cell("Definitions" + doc), "",
            "For example, with rollout.val_kwargs.n = 4 (gpu_jobs.reward.val_metrics):", ""]
    return "\n".join(out + [f"- `{n}`" for n in _validation_names()] + [""])
