#!/usr/bin/env bash
# A local Prefect for rlmill: server (API + UI), a process worker, and the deployments.
#
#   scripts/prefect_local.sh server    # API + UI on http://127.0.0.1:${PORT:-4200} (make server), logs streamed to --watch
#   RLMILL_PREFECT_DB=postgres scripts/prefect_local.sh server   # the same on PostgreSQL (make server DB=postgres)
#   scripts/prefect_local.sh worker    # process worker on pool ${RLMILL_WORK_POOL:-local} (make worker)
#   scripts/prefect_local.sh deploy    # pool if missing + deployments/prefect.yaml (make deploy)
#   scripts/prefect_local.sh ui-url    # the address `server` gives the UI (browsers open it)
#
# Environment: PORT (4200), RLMILL_SERVER_HOST (127.0.0.1: the address the server listens on; 0.0.0.0 serves
# other machines, as the api host of `make cluster` does), PREFECT_API_URL (http://127.0.0.1:$PORT/api, for worker and deploy),
# RLMILL_WORK_POOL (local), RLMILL_NIGHTLY_TZ (UTC; the nightly 02:00 schedule's time zone),
# PREFECT_HOME (~/.prefect: the server's SQLite database lives there), RLMILL_SERVER_WAIT_S (30:
# seconds worker/deploy wait for the server to answer), RLMILL_PREFECT_DB (sqlite: the server's
# database; postgres: a local cluster started by scripts/postgres_local.sh, in RLMILL_PG_DIR
# (.rlmill/postgres) on PGPORT (a free port); a PostgreSQL of your own: leave it sqlite and set
# PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# The worker starts flow runs with its own Python: put the repo's venv first.
export PATH="$REPO/.venv/bin:$PATH"
export PORT="${PORT:-4200}"
export RLMILL_WORK_POOL="${RLMILL_WORK_POOL:-local}"
export RLMILL_NIGHTLY_TZ="${RLMILL_NIGHTLY_TZ:-UTC}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 GX_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}"

need_server() {
  # Without a reachable PREFECT_API_URL the CLI would start a throwaway ephemeral server and the
  # deployments (or the worker's polling) would go nowhere: fail loudly instead.
  export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:$PORT/api}"
  if ! python - "$PREFECT_API_URL" "${RLMILL_SERVER_WAIT_S:-30}" <<'PY'
import sys, time, urllib.request
for _ in range(max(1, int(sys.argv[2]))):
    try:
        urllib.request.urlopen(sys.argv[1].rstrip("/") + "/health", timeout=5).read()
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
PY
  then
    echo "prefect_local.sh: no Prefect server answers at $PREFECT_API_URL;" \
         "start one with 'make server' (or set PREFECT_API_URL)" >&2
    exit 1
  fi
}

ui_api_url() {
  # The bundled UI is told where the API is through PREFECT_UI_API_URL; without it, it asks
  # the default port 4200 even when the server listens elsewhere. A browser elsewhere cannot
  # reach "0.0.0.0" (every address here): it gets this machine's first address instead.
  local host="${RLMILL_SERVER_HOST:-127.0.0.1}"
  if [ "$host" = "0.0.0.0" ] || [ "$host" = "::" ]; then
    host="$(hostname -I 2>/dev/null | awk '{print $1}')"
    host="${host:-$(hostname)}"
    case "$host" in *:*) host="[$host]" ;; esac  # an IPv6 address in a URL
  fi
  export PREFECT_UI_API_URL="${PREFECT_UI_API_URL:-http://$host:$PORT/api}"
}

use_database() {
  # SQLite (in PREFECT_HOME) needs nothing; PostgreSQL is started here, idempotently, and stays
  # up after the server stops (its data is kept for the next `make server DB=postgres`).
  case "${RLMILL_PREFECT_DB:-sqlite}" in
    sqlite) ;;
    postgres)
      if [ -n "${PREFECT_API_DATABASE_CONNECTION_URL:-}" ]; then
        echo "rlmill: DB=postgres starts a local PostgreSQL, but PREFECT_API_DATABASE_CONNECTION_URL is" \
             "already set: unset it, or leave DB unset to serve from the database it names" >&2
        exit 2
      fi
      PREFECT_API_DATABASE_CONNECTION_URL="$(bash "$REPO/scripts/postgres_local.sh" start)" || exit 1
      export PREFECT_API_DATABASE_CONNECTION_URL
      ;;
    *)
      echo "rlmill: DB=${RLMILL_PREFECT_DB} is not a database the Prefect server runs on here:" \
           "DB=sqlite (the default, in PREFECT_HOME) or DB=postgres (a local cluster in .rlmill/postgres)" >&2
      exit 2
      ;;
  esac
}

case "${1:-}" in
  server)
    use_database
    ui_api_url
    echo "rlmill: the UI is at ${PREFECT_UI_API_URL%/api} (PREFECT_UI_API_URL sets the address browsers use)" >&2
    # `prefect deployment run --watch` prints a run's log lines only when the server streams
    # logs out (off by default): with it, a failed run's `rlmill:` line (the reason and the fix)
    # shows right above "Flow run finished in state 'Failed'".
    export PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED="${PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED:-true}"
    export PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED="${PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED:-true}"
    exec prefect server start --host "${RLMILL_SERVER_HOST:-127.0.0.1}" --port "$PORT"
    ;;
  ui-url)
    ui_api_url
    echo "${PREFECT_UI_API_URL%/api}"
    ;;
  worker)
    need_server
    exec prefect worker start --pool "$RLMILL_WORK_POOL" --type process
    ;;
  deploy)
    need_server
    if ! prefect work-pool inspect "$RLMILL_WORK_POOL" >/dev/null 2>&1; then
      # A worker starting at the same moment may create it first: that is fine.
      prefect work-pool create "$RLMILL_WORK_POOL" --type process >/dev/null 2>&1 \
        || prefect work-pool inspect "$RLMILL_WORK_POOL" >/dev/null
    fi
    exec prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
    ;;
  *)
    sed -n '2,17p' "$0" >&2
    exit 2
    ;;
esac
