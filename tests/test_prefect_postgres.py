"""Prefect on PostgreSQL: scripts/postgres_local.sh (the throwaway cluster `make server DB=postgres`
starts) and a deployment run through a local Prefect whose server keeps its state in PostgreSQL.

    .venv/bin/python -m pytest -q tests/test_prefect_postgres.py            # the script, seconds
    .venv/bin/python -m pytest -q tests/test_prefect_postgres.py -m e2e     # the deployment run, ~2-4 min
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.servers import PREFECT_LOCAL, LocalPrefect, PostgresCluster, postgres_missing, postgres_server
from tests.tiny import tiny_overrides

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
RUN_TIMEOUT_S = 600  # server start with migrations (~30 s busy), deploy, worker poll, one tiny iteration


@pytest.fixture(scope="module", autouse=True)
def _postgres_installed():
    if (why := postgres_missing()) is not None:
        pytest.skip(f"{why} (bash scripts/ensure_test_tools.sh installs it as root)")


def test_cluster_starts_once_refuses_a_taken_port_and_keeps_its_data():
    with postgres_server() as pg:
        assert pg.url.startswith("postgresql+asyncpg://rlmill:") and pg.url.endswith(f"@127.0.0.1:{pg.port}/prefect")
        assert pg.start().url == pg.url  # a second start finds it running: the same cluster, same URL
        pg.sql("create table kept (n int); insert into kept values (29)")

        other = PostgresCluster(port=pg.port)  # same port, another folder
        taken = other.script("start", check=False)
        other.remove()
        assert taken.returncode == 1 and taken.stdout == "", taken
        assert taken.stderr == (f"rlmill: port {pg.port} on 127.0.0.1 is in use (another PostgreSQL?): "
                                "set PGPORT to a free port, or unset it to pick one\n")

        pg.stop()
        assert pg.script("status", check=False).returncode == 3
        assert pg.script("url").stdout.strip() == pg.url  # the URL outlives the process
        assert pg.start().sql("select n from kept") == [["29"]]  # restarted on its data


def test_missing_postgres_and_unknown_database_are_one_line_errors(tmp_path):
    pg = PostgresCluster(tmp_path / "pg")
    missing = pg.script("start", check=False, env={"RLMILL_PG_BIN": str(tmp_path)})
    assert missing.returncode == 1 and missing.stderr == (
        f"rlmill: RLMILL_PG_BIN={tmp_path} holds no initdb: point it at PostgreSQL's bin folder, or unset it\n")

    env = {**os.environ, "RLMILL_PREFECT_DB": "mysql", "PORT": "1"}
    done = subprocess.run(["bash", str(PREFECT_LOCAL), "server"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("rlmill: DB=mysql is not a database"), done
    assert len(done.stderr.splitlines()) == 1


def _wait_final(prefect: LocalPrefect, flow_run_id: str, worker_log) -> str:
    """The flow run's state type once PostgreSQL holds a final one (read there, not through the API)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        rows = prefect.postgres.sql(f"select state_type from flow_run where id = '{flow_run_id}'")
        if rows and rows[0][0] in FINAL:
            return rows[0][0]
        if time.monotonic() > deadline:
            raise AssertionError(f"flow run {flow_run_id} did not reach a final state in PostgreSQL within "
                                 f"{RUN_TIMEOUT_S} s (last: {rows}); worker log:\n{worker_log.read_text()[-3000:]}")
        time.sleep(2)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.prefect
def test_a_deployment_run_completes_on_a_postgres_backed_server(tmp_path):
    with LocalPrefect(tmp_path / "prefect", pool="rlmill-pg-test", db="postgres") as prefect:
        prefect.deploy()
        worker_log = prefect.logs[prefect.start_worker().pid]
        flow_run_id = prefect.trigger("rl-training/manual", {
            "iterations": 1, "overrides": tiny_overrides(str(tmp_path / "root"), "run_id=pg-manual")})
        state = _wait_final(prefect, flow_run_id, worker_log)
        assert state == "COMPLETED", worker_log.read_text()[-3000:]

        pg = prefect.postgres
        assert pg.sql("select d.name, f.name from deployment d join flow f on f.id = d.flow_id "
                      f"join flow_run r on r.deployment_id = d.id where r.id = '{flow_run_id}'") == [["manual", "rl-training"]]
        # The iteration's subflow and its task runs (stage states arrive as events) are there too.
        subflows = pg.sql("select r.name from flow_run r join task_run t on r.parent_task_run_id = t.id "
                          f"where t.flow_run_id = '{flow_run_id}'")
        assert subflows, "no subflow run of the deployment run in PostgreSQL"
        assert int(pg.sql("select count(*) from task_run")[0][0]) > len(subflows)
        assert not (prefect.work / "home" / "prefect.db").exists()  # nothing went to SQLite
