"""What a chaos scenario checks after the fault: nothing committed lost, changed or duplicated,
and every iteration produced.

    snap = snapshot(layout)            # every committed manifest's bytes, before the fault
    ...fault, recovery...
    report = audit(layout, snap, iterations=3)
    report.data_lost                   # committed, then gone, changed, unreadable or duplicated: must be 0
    report.not_finished                # stages of the 3 iterations never committed: 0 once the run completed
    audit(layout, snap, 3, staleness_threshold=1)   # async: each rollout used once, with its scheduled weights

The two are kept apart: a run that stops early has lost nothing it committed, it has work left
to do (resume it); data lost means something committed is no longer what it was.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from storage import MANIFEST_NAME, RunLayout, join, read_table, url_to_fs


def committed_manifests(layout: RunLayout) -> dict[str, str]:
    """URL -> sha256 of every committed stage manifest of the run (storage's one walk of them)."""
    out = {}
    for _, _, uri in layout.committed_stages():
        fs, path = url_to_fs(uri, layout.storage)
        out[uri] = hashlib.sha256(fs.cat_file(path)).hexdigest()
    return out


def snapshot(layout: RunLayout) -> dict[str, str]:
    return committed_manifests(layout)


@dataclass
class AuditReport:
    lost: list[str] = field(default_factory=list)        # committed before, gone after
    changed: list[str] = field(default_factory=list)     # committed before, different bytes after
    unreadable: list[str] = field(default_factory=list)  # a listed shard missing or failing its sha256
    missing: list[str] = field(default_factory=list)     # a stage of an iteration never committed
    duplicated: list[str] = field(default_factory=list)  # rows committed twice within a stage
    misused: list[str] = field(default_factory=list)     # async: a rollout not used exactly once, or stale wrongly

    @property
    def data_lost(self) -> int:
        """Committed, then gone, changed, unreadable or duplicated."""
        return len(self.lost) + len(self.changed) + len(self.unreadable) + len(self.duplicated) + len(self.misused)

    @property
    def not_finished(self) -> int:
        """Stages of the expected iterations that were never committed (the run has work left)."""
        return len(self.missing)

    def summary(self) -> str:
        parts = [f"{name}: {', '.join(v[:3])}" for name, v in vars(self).items() if v]
        return "; ".join(parts) or "intact"


def _check_table(uri: str, layout: RunLayout, report: AuditReport) -> None:
    try:
        table = read_table(uri, storage=layout.storage)  # storage's verifier: every shard's size and sha256
    except Exception as e:  # noqa: BLE001 - any failure to read committed data is a loss
        report.unreadable.append(f"{uri} ({type(e).__name__})")
        return
    if "uid" in table.column_names:
        uids = table.column("uid").to_pylist()
        if len(set(uids)) != len(uids):
            report.duplicated.append(uri)


def rollout_lineage(layout: RunLayout, iterations: int, staleness_threshold: int) -> list[str]:
    """Async runs: every committed rollout k sampled with the weights the schedule names
    (update max(0, k-1-s)), and is the input of exactly one gate, iteration k's. A rollout lost
    and made again with other weights, or consumed by two iterations, is named here."""
    from storage import committed, read_manifest

    problems, used_by = [], {}
    for k in range(1, iterations + 1):
        if uri := committed(layout.stage(k, "rollout"), layout.storage):
            version = read_manifest(uri, layout.storage).metrics.get("async/weights_version")
            if version != max(0, k - 1 - staleness_threshold):
                problems.append(f"rollout {k} sampled with the weights of update {version}")
        if gate := committed(layout.stage(k, "gate"), layout.storage):
            inputs = read_manifest(gate, layout.storage).inputs
            for src in inputs:
                used_by.setdefault(src, []).append(k)
            if uri and uri not in inputs:
                problems.append(f"gate {k} did not read rollout {k}")
    problems += [f"{src} used by iterations {ks}" for src, ks in used_by.items() if len(ks) > 1]
    return problems


def audit(layout: RunLayout, before: dict[str, str], iterations: int | None = None,
          damaged: set[str] = frozenset(), staleness_threshold: int | None = None) -> AuditReport:
    """Compare the run's committed manifests with `before`; read back every committed table.

    `damaged` lists manifests whose data the fault itself destroyed (a corrupted shard): those are
    expected to be unreadable and are not counted as lost by rlmill.
    """
    report = AuditReport()
    now = committed_manifests(layout)
    for url, sha in before.items():
        if url in damaged:  # destroyed by the fault itself; recomputed or reported, not lost by rlmill
            continue
        if url not in now:
            report.lost.append(url)
        elif now[url] != sha:
            report.changed.append(url)
    for url in sorted(now):
        if url not in damaged:
            _check_table(url, layout, report)
    for k in range(1, (iterations or 0) + 1):
        for stage in ("rollout", "gate", "reward", "advantages", "update", "commit"):
            if join(layout.stage(k, stage), MANIFEST_NAME) not in now:
                report.missing.append(f"iteration {k} {stage}")
    if staleness_threshold is not None:
        report.misused = rollout_lineage(layout, iterations or 0, staleness_threshold)
    return report
