"""Test servers for tests and benchmarks: a real S3 endpoint on loopback via `moto_server`, a
real Prefect API server (`prefect server start`, SQLite in its own PREFECT_HOME), and a whole
local Prefect (server, deployments, process workers) started the way `make server/deploy/worker` do.

    with MotoServer() as s3:
        cfg = s3.config()          # StorageConfig for it
        url = s3.new_bucket()      # 's3://bucket-<hex>'
    with PrefectServer(home) as prefect:
        env = {**os.environ, "PREFECT_API_URL": prefect.api_url}
    with LocalPrefect(work, pool="rlmill-test") as prefect:     # server started, healthy
        prefect.deploy(); prefect.start_worker()
        flow_run_id = prefect.trigger("rl-training/manual", {"iterations": 1})
    with LocalPrefect(work, pool="rlmill-test", db="postgres") as prefect:   # the same on PostgreSQL
        prefect.postgres.sql("select count(*) from flow_run")           # [['0']]
    with postgres_server() as pg:                                    # scripts/postgres_local.sh's cluster
        env = {"PREFECT_API_DATABASE_CONNECTION_URL": pg.url}

RLMILL_TEST_PREFECT_DB=postgres puts every LocalPrefect that is not given `db` on PostgreSQL (the
deployment tests, benchmarks/async_pools.py, the chaos scenarios):
    RLMILL_TEST_PREFECT_DB=postgres .venv/bin/python -m pytest -q tests/deployments/test_async_pools.py

Lives in tests/, not in the product packages; it needs `moto[server]` installed. Benchmarks import
it as `tests.servers` (they run as `python -m benchmarks...` from the repository root).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from zoneinfo import ZoneInfo

from gpu_jobs.train.ranks.dist import free_port
from storage import StorageConfig

__all__ = ["LocalPrefect", "MotoServer", "PostgresCluster", "PrefectServer", "free_port", "nightly_timezone",
           "postgres_missing", "postgres_server", "start_moto_server", "stop_group", "stop_process", "wait_for_api"]

REPO = Path(__file__).resolve().parents[1]
PREFECT_LOCAL = REPO / "scripts" / "prefect_local.sh"  # what `make server`, `make deploy`, `make worker` run
POSTGRES_LOCAL = REPO / "scripts" / "postgres_local.sh"  # what `make server DB=postgres` starts first
PREFECT_DATABASES = ("sqlite", "postgres")  # scripts/prefect_local.sh's RLMILL_PREFECT_DB

MOTO_KEY = "rlmill-test-key"
MOTO_SECRET = "rlmill-test-secret"


def nightly_timezone(now: dt.datetime | None = None) -> str:
    """A non-UTC zone whose next 02:00 is more than an hour away, so the worker started by these
    tests never picks up a real scheduled night (Tokyo and New York 02:00 are 10-11 h apart)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    for tz in ("Asia/Tokyo", "America/New_York"):
        local = now.astimezone(ZoneInfo(tz))
        nxt = local.replace(hour=2, minute=0, second=0, microsecond=0)
        if nxt <= local:
            nxt += dt.timedelta(days=1)
        if nxt - local > dt.timedelta(hours=1):
            return tz
    return "Asia/Tokyo"  # unreachable: the two 02:00s are never both within the hour


def moto_server_exe() -> str | None:
    """The moto_server beside this interpreter (the venv's bin dir), else on PATH."""
    exe = Path(sys.executable).parent / "moto_server"
    return str(exe) if exe.exists() else shutil.which("moto_server")


def start_moto_server(extra_env: dict[str, str] | None = None, timeout: float = 30.0):
    """Start `moto_server -H 127.0.0.1 -p <free port>`; returns (Popen, endpoint_url) once it answers."""
    exe = moto_server_exe()
    if exe is None:
        raise FileNotFoundError("moto_server not found: pip install 'moto[server]'")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(extra_env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout}s") from None
            time.sleep(0.1)


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a process we started, by its PID: SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of `pid` (from /proc; [] where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop a process we started with start_new_session=True, and its children, by PID:
    SIGTERM, then SIGKILL after `grace` s. `prefect server start` runs uvicorn in a session of
    its own, so the children are collected by PID before the signal, not only by group."""
    if proc.poll() is not None:
        return
    pids = [proc.pid, *_descendants(proc.pid)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            if not any(_alive(p) for p in pids):
                return
            time.sleep(0.2)
    proc.wait(timeout=5)


class MotoServer:
    """A moto S3 server subprocess for the life of a `with` block.

    Example:
        >>> with MotoServer() as s3:  # doctest: +SKIP
        ...     url = s3.new_bucket()
    """

    def __init__(self, extra_env: dict[str, str] | None = None):
        self.extra_env = extra_env
        self.proc: subprocess.Popen | None = None
        self.endpoint_url = ""
        self.key, self.secret = MOTO_KEY, MOTO_SECRET

    def __enter__(self) -> "MotoServer":
        self.proc, self.endpoint_url = start_moto_server(self.extra_env)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def config(self) -> StorageConfig:
        return StorageConfig(endpoint_url=self.endpoint_url, key=self.key, secret=self.secret)

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default); returns its s3:// URL."""
        import boto3

        name = name or f"bucket-{uuid.uuid4().hex[:12]}"
        client = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.key,
                              aws_secret_access_key=self.secret, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


def postgres_missing() -> str | None:
    """Why no PostgreSQL cluster can start here (scripts/postgres_local.sh's one `rlmill:` line:
    not installed, no account to run it as), or None when one can."""
    done = subprocess.run(["bash", str(POSTGRES_LOCAL), "check"], capture_output=True, text=True, timeout=60)
    return None if done.returncode == 0 else (done.stderr.strip() or f"postgres_local.sh check: exit {done.returncode}")


class PostgresCluster:
    """scripts/postgres_local.sh's throwaway PostgreSQL in `folder` on `port` (default: a fresh
    folder under the system's temporary folder, a free port). The default folder is not under
    pytest's tmp_path: as root the cluster runs as the `postgres` account, and pytest's folders
    (/tmp/pytest-of-root, mode 700) are closed to it.

    Example:
        >>> pg = PostgresCluster().start()  # doctest: +SKIP
        >>> pg.sql("select current_database()")  # doctest: +SKIP
        [['prefect']]
        >>> pg.stop(); pg.remove()  # doctest: +SKIP
    """

    def __init__(self, folder: str | os.PathLike | None = None, port: int | None = None):
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="rlmill-pg-"))
        self.port = port or free_port()
        self.env = {"RLMILL_PG_DIR": str(self.folder), "PGPORT": str(self.port)}  # what the script reads
        self.url = ""  # postgresql+asyncpg://...: PREFECT_API_DATABASE_CONNECTION_URL, once started

    def script(self, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`scripts/postgres_local.sh ARGS` for this cluster (plus `env`); raises with its stderr
        when it fails and `check`."""
        done = subprocess.run(["bash", str(POSTGRES_LOCAL), *args], env={**os.environ, **self.env, **(env or {})},
                              capture_output=True, text=True, timeout=180)
        if check and done.returncode:
            raise RuntimeError(f"postgres_local.sh {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def start(self) -> "PostgresCluster":
        """Initialise (once) and start it; idempotent. Sets `url`."""
        self.url = self.script("start").stdout.strip()
        return self

    def sql(self, query: str) -> list[list[str]]:
        """Rows of `query` in the cluster's `prefect` database, each a list of column texts."""
        out = self.script("psql", "-At", "-F", "\t", "-v", "ON_ERROR_STOP=1", "-c", query).stdout
        return [line.split("\t") for line in out.splitlines()]

    def stop(self) -> None:
        """Stop it by its PID file (the script: fast shutdown, immediate after 30 s)."""
        self.script("stop")

    def remove(self, keep_log: Path | None = None) -> None:
        """Delete its folder (stopped first), copying its server log to `keep_log` first when given."""
        log = self.folder / "postgres.log"
        if keep_log is not None and log.exists():
            shutil.copyfile(log, keep_log)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def postgres_server(folder: str | os.PathLike | None = None, port: int | None = None):
    """A started PostgresCluster for the life of a `with` block; stopped, and its folder removed
    when this made it, at the end."""
    cluster = PostgresCluster(folder, port)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if folder is None:
            cluster.remove()


@contextlib.contextmanager
def module_prefect_api():
    """Prefect's test harness (a fresh API server and database) for one test module; yields its
    URL. The process's event and log workers are drained first: each is bound to the API that
    was current when it started (the session server, after any earlier test of this process ran
    a flow), and the harness drains them only on exit, so the module's task-run states (sent as
    events) and logs would otherwise land on the other server."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    EventsWorker.drain_all()
    APILogWorker.drain_all()
    with prefect_test_harness(server_startup_timeout=180):  # which drains them again on exit
        yield PREFECT_API_URL.value()


def wait_for_api(api_url: str, log: Path, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Block until a Prefect API answers /health (~11 s after its start on idle cores, ~30 s on
    busy ones); raises with the end of its log when it does not within `timeout` s, or when
    `proc`, its process, ended. The caller stops the process."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{api_url}/health", timeout=5).read()
            return
        except OSError:
            exited = proc is not None and proc.poll() is not None
            if exited or time.monotonic() > deadline:
                tail = log.read_text()[-3000:] if log.exists() else "(no log)"
                why = f"exited ({proc.returncode}) before answering /health" if exited else \
                    f"did not answer /health within {timeout:.0f} s"
                raise RuntimeError(f"prefect server {api_url} {why} (log {log}):\n{tail}") from None
            time.sleep(0.3)


class PrefectServer:
    """`prefect server start` on a free loopback port, with its database in `home` (PREFECT_HOME),
    for the life of a `with` block (or start()/stop()). The UI is off: the tests that look at the
    UI start the server the README's way (scripts/prefect_local.sh).

    Example:
        >>> with PrefectServer(tmp_path) as prefect:  # doctest: +SKIP
        ...     subprocess.run(["rlmill", "train"], env={**os.environ, "PREFECT_API_URL": prefect.api_url})
    """

    def __init__(self, home: str | os.PathLike, startup_timeout: float = 180.0):
        self.home, self.timeout = Path(home), startup_timeout
        self.proc: subprocess.Popen | None = None
        self.api_url = ""

    def start(self, wait: bool = True) -> "PrefectServer":
        """Start it; with wait=False return at once and call wait_healthy() before first use."""
        self.home.mkdir(parents=True, exist_ok=True)
        port, log = free_port(), self.home / "server.log"
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "DO_NOT_TRACK": "1", "PREFECT_UI_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.api_url = f"http://127.0.0.1:{port}/api"
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        try:
            wait_for_api(self.api_url, self.home / "server.log", self.timeout, self.proc)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM the server and its uvicorn child (in a session of its own), SIGKILL after 5 s."""
        if self.proc is not None:
            stop_group(self.proc, grace=5.0)

    def __enter__(self) -> "PrefectServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalPrefect:
    """A real local Prefect started the way `make server`, `make deploy` and `make worker` do
    (scripts/prefect_local.sh): a server on a free port with its own PREFECT_HOME under `work`,
    the deployments on work pool `pool`, process workers. Every process it starts is in a
    session of its own and stopped by PID (`close`: SIGTERM, SIGKILL after a grace: a process
    worker may ignore SIGTERM). `env` is the environment of every child (and of a flow process
    that should use this server); `env=None` starts from this process's.

    `db` is the server's database, as `make server DB=...` takes it: "sqlite" (in PREFECT_HOME)
    or "postgres" (a throwaway PostgresCluster on a free port, `self.postgres`, started by the
    server script like `make server DB=postgres` does, stopped and removed by `close`); None
    reads RLMILL_TEST_PREFECT_DB, default sqlite.

    Used by the deployment tests (tests/deployments/conftest.py), the two work pools of
    benchmarks/async_pools.py and the chaos scenarios on a local Prefect (benchmarks/chaos/orchestrator.py).
    """

    def __init__(self, work: str | os.PathLike, pool: str, env: dict[str, str] | None = None, db: str | None = None):
        from gpu_jobs.train.ranks.dist import child_env

        self.db = db or os.environ.get("RLMILL_TEST_PREFECT_DB") or "sqlite"
        if self.db not in PREFECT_DATABASES:
            raise ValueError(f"rlmill: LocalPrefect db={self.db!r} (or RLMILL_TEST_PREFECT_DB) is not one of "
                             f"{', '.join(PREFECT_DATABASES)}")
        self.work, self.pool = Path(work), pool
        self.work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = child_env(env)  # not this process's MASTER_PORT etc. if it started DeepSpeed
        self.env.update({
            "PREFECT_HOME": str(self.work / "home"), "PORT": str(port), "PREFECT_API_URL": self.api,
            "PATH": f"{REPO / '.venv' / 'bin'}:{self.env.get('PATH', '')}", "RLMILL_WORK_POOL": pool,
            "RLMILL_NIGHTLY_TZ": nightly_timezone(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "GX_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
            # The scheduler fills upcoming runs every loop (default 60 s): make the first fill prompt.
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
            # Workers poll every 10 s by default: most of a deployment run's start-up wait here.
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        for key in ("PREFECT_PROFILE", "PREFECT_UI_API_URL"):
            self.env.pop(key, None)
        # Only the server's process learns where its database is (the script starts PostgreSQL).
        self.postgres = PostgresCluster() if self.db == "postgres" else None
        self.server_env = {"RLMILL_PREFECT_DB": self.db, **(self.postgres.env if self.postgres else {})}
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}  # pid -> its log
        self.server: subprocess.Popen | None = None  # the server last started

    def start(self, what: str, pool: str | None = None) -> subprocess.Popen:
        """`scripts/prefect_local.sh server|worker` (a worker polls `pool`, default this one's),
        logging to <work>/<what>-<n>.log."""
        log = self.work / f"{what}-{len(self.procs)}.log"
        env = {**self.env, "RLMILL_WORK_POOL": pool or self.pool, **(self.server_env if what == "server" else {})}
        if what == "server" and self.postgres is not None:
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)  # a developer's own: not this server's
        with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(["bash", str(PREFECT_LOCAL), what], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def start_server(self, timeout: float = 180.0) -> subprocess.Popen:
        """A server on this one's port and database (again, after a stop: same database), once it answers."""
        self.server = self.start("server")
        wait_for_api(self.api, self.logs[self.server.pid], timeout, self.server)
        return self.server

    def start_worker(self, pool: str | None = None) -> subprocess.Popen:
        return self.start("worker", pool)

    def deploy(self, timeout: float = 400.0) -> str:
        """`scripts/prefect_local.sh deploy`: the pool and every deployment; returns its output."""
        return self.cli(["bash", str(PREFECT_LOCAL), "deploy"], timeout=timeout)

    def cli(self, args: list[str], timeout: float = 300.0, **env: str) -> str:
        """A command from the repository root with this Prefect's environment (plus `env`);
        returns its stdout, raises with its output when it fails."""
        done = subprocess.run(args, cwd=REPO, env={**self.env, **env}, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                               f"{done.stderr[-4000:]}")
        return done.stdout

    def trigger(self, name: str, params: dict, job_variables: dict | None = None) -> str:
        """A run of deployment NAME with these parameters (and job variables), as `prefect
        deployment run NAME -p k=v ...` makes it; returns the flow run's id. Created through the
        client with an idempotency key, which the CLI has no option for: on a busy SQLite server
        the CLI's create, retried by Prefect's client after a slow answer, once made two flow runs
        of one trigger (make test, 2026-12-02: the nightly's second run met the first's run lock).
        The README walkthrough runs the CLI itself."""
        import asyncio

        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        async def create() -> str:
            with temporary_settings(updates={PREFECT_API_URL: self.env["PREFECT_API_URL"]}):
                async with get_client() as client:
                    deployment = await client.read_deployment_by_name(name)
                    run = await client.create_flow_run_from_deployment(
                        deployment.id, parameters=params, job_variables=job_variables or None,
                        idempotency_key=uuid.uuid4().hex)
                    return str(run.id)

        return asyncio.run(create())

    def close(self, grace: float = 15.0) -> None:
        for proc in reversed(self.procs):
            stop_group(proc, grace=grace)
        if self.postgres is not None:  # after the server, its only client; its log stays in `work`
            try:
                self.postgres.stop()
            finally:
                self.postgres.remove(keep_log=self.work / "postgres.log")

    def __enter__(self) -> "LocalPrefect":
        try:
            self.start_server()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alive_pids(pids) -> list[int]:
    """The processes of `pids` still running (a zombie, exited but not reaped, counts as gone)."""
    import psutil

    left = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
    return left
