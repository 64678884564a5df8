"""The generated reference pages (flows/reference.py) and the mkdocs hook that adds them
(scripts/docs_hooks.py): every config key has an entry with help text, a field without help
text is refused by name, and the metric names come from the source. No site is built here
(tests/test_docs_site.py builds it).

    .venv/bin/python -m pytest -q tests/flows/test_reference.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.reference import MissingHelp, config_reference, field_at, leaf_keys, metric_names, metrics_reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config_page() -> str:
    return config_reference()


@pytest.fixture(scope="module")
def metrics_page() -> str:
    return metrics_reference()


def _rows(page: str) -> dict[str, list[str]]:
    """First cell's code text -> the row's other cells, for every table row of the page."""
    rows = {}
    for line in page.splitlines():
        m = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = re.split(r"(?<!\\) \| ", m.group(2))
    return rows


def test_every_config_key_has_an_entry_with_type_default_and_help(config_page):
    from gpu_jobs.stages.config import config_keys

    # The run config's tables only: the verl table has rows for data.* keys too.
    rows, keys = _rows(config_page.split("## verl keys")[0]), leaf_keys()
    assert len(keys) > 150 and set(keys) <= set(config_keys())
    assert [k for k in keys if k not in rows] == []  # 0 keys without a generated entry
    assert [k for k in keys if not (len(rows[k]) == 3 and all(c.strip() for c in rows[k]))] == []
    assert rows["rollout.n"][:2] == ["`int`", "`8`"]
    # The default a run gets, not only the field's: the run config picks grpo when none is named.
    assert rows["algorithm.adv_estimator"][1] == '`"grpo"`'
    assert rows["trainer.placement"][0] == "`one of 'colocated', 'remote'`"
    assert rows["reward.score_range"][0] == "`tuple[float, float], optional`"


def test_registry_choices_are_listed(config_page):
    from gpu_jobs.algos import ADVANTAGE_ESTIMATORS
    from gpu_jobs.rollout import ROLLOUT_ENGINES

    rows = _rows(config_page.split("## verl keys")[0])
    assert all(name in rows["algorithm.adv_estimator"][0] for name in ADVANTAGE_ESTIMATORS)
    assert all(name in rows["rollout.engine"][0] for name in ROLLOUT_ENGINES)
    assert "registered policy loss" in rows["actor.policy_loss.loss_mode"][0]


def test_a_field_without_help_is_refused_by_name(monkeypatch):
    _, _, info = field_at("rollout.val_kwargs.top_k")
    monkeypatch.setattr(info, "description", None)
    with pytest.raises(MissingHelp, match=r"rollout\.val_kwargs\.top_k"):
        config_reference()


def test_verl_aliases_serve_flags_and_canary_keys(config_page):
    from flows.cli import build_parser
    from flows.nightly import CanaryPolicy
    from flows.reference import _subparser
    from flows.verl_keys import VERL_KEYS

    rows = _rows(config_page)
    assert [k for k in VERL_KEYS if k not in rows] == []
    assert "`actor.lr`" in rows["actor_rollout_ref.actor.optim.lr"][0]
    serve = _subparser(build_parser(), "serve")
    flags = [max(a.option_strings, key=len) for a in serve._actions if a.option_strings and a.dest != "help"]
    assert "--max-body-bytes" in flags and [f for f in flags if f not in rows] == []
    assert {f"canary_test.{n}" for n in CanaryPolicy.__dataclass_fields__ if n != "share"} <= set(rows)
    assert rows["canary_share"][1] == "`0.0`"


def test_metric_names_come_from_the_source(metrics_page):
    from flows.reporting import HEADLINE

    names = metric_names()
    for name in ("actor/pg_loss", "critic/score/mean", "timing_s/gen", "perf/throughput",
                 "training/rollout_probs_diff_mean", "critic/advantages/max"):  # the last from a stats helper
        assert f"| `{name}` |" in metrics_page
    assert "gpu_jobs.algos.policy_losses" in names["actor/pg_loss"]
    assert [m for m in HEADLINE if f"| `{m}` |" not in metrics_page] == []  # the artifact's first metrics
    assert "openai/gsm8k" not in names and "critic/score" not in names  # a data source; a helper's prefix
    assert "`val-core/<data_source>/acc/mean@4`" in metrics_page


def test_the_hook_adds_both_pages_as_generated_files(tmp_path, monkeypatch):
    pytest.importorskip("mkdocs", reason="mkdocs is installed by `bash scripts/ensure_venv.sh test bench docs`")
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import File, Files

    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "docs" / "reference" / "config.md").write_text("stale")
    # Loaded the way mkdocs.yml's `hooks:` loads it, and called through mkdocs' own event dispatch.
    cfg = MkDocsConfig()
    cfg.load_dict({"site_name": "t", "docs_dir": str(tmp_path / "docs"), "site_dir": str(tmp_path / "site"),
                   "hooks": [str(ROOT / "scripts" / "docs_hooks.py")]})
    assert cfg.validate()[0] == []
    hooks = cfg.plugins[str(ROOT / "scripts" / "docs_hooks.py")]
    assert hooks.PAGES == {"reference/config.md": config_reference, "reference/metrics.md": metrics_reference}
    # The pages themselves are checked above; here, what the hook does with them.
    monkeypatch.setattr(hooks, "PAGES", {uri: (lambda uri=uri: f"# {uri}\n") for uri in hooks.PAGES})
    stale = File("reference/config.md", cfg.docs_dir, cfg.site_dir, cfg.use_directory_urls)
    files = cfg.plugins.on_files(Files([stale]), config=cfg)
    assert sorted(f.src_uri for f in files) == ["reference/config.md", "reference/metrics.md"]
    assert sorted(f.content_string for f in files) == ["# reference/config.md\n", "# reference/metrics.md\n"]
    assert all(f.generated_by for f in files)
