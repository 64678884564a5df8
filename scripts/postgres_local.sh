#!/usr/bin/env bash
# A throwaway PostgreSQL cluster in a folder: the database of `make server DB=postgres` and of the
# tests' LocalPrefect(db="postgres") (tests/servers.py).
#
#   scripts/postgres_local.sh start        # initialise once, start (idempotent); prints the connection URL
#   scripts/postgres_local.sh url          # the URL of the cluster in the folder (running or not)
#   scripts/postgres_local.sh stop         # stop it by its PID file (nothing running: says so, exit 0)
#   scripts/postgres_local.sh status       # exit 0 when it runs, 3 when it does not
#   scripts/postgres_local.sh psql [ARGS]  # psql into its `prefect` database (e.g. -c 'select count(*) from flow_run')
#   scripts/postgres_local.sh check        # only the preflight: PostgreSQL installed, a user to run it as
#
# Environment: RLMILL_PG_DIR (.rlmill/postgres: data/, postgres.log, port, password), PGPORT (the
# port to listen on, 127.0.0.1 only; unset: the port of the last start, else a free one),
# RLMILL_PG_BIN (the folder holding initdb and pg_ctl; default: initdb on PATH, else the newest
# /usr/lib/postgresql/*/bin), RLMILL_PG_USER (postgres: the account the cluster runs as when this
# script runs as root, which PostgreSQL refuses). The URL is what Prefect's server takes:
#   PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://rlmill:<password>@127.0.0.1:<port>/prefect
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${RLMILL_PG_DIR:-$REPO/.rlmill/postgres}"
DATA="$DIR/data"
DB_USER=rlmill DB_NAME=prefect

die() { echo "rlmill: $*" >&2; exit 1; }
say() { echo "[rlmill] $*" >&2; }

find_bin() {
  # Debian keeps the server programs off PATH (/usr/lib/postgresql/<version>/bin).
  if [ -n "${RLMILL_PG_BIN:-}" ]; then
    [ -x "$RLMILL_PG_BIN/initdb" ] || die "RLMILL_PG_BIN=$RLMILL_PG_BIN holds no initdb: point it at PostgreSQL's bin folder, or unset it"
    BIN="$RLMILL_PG_BIN"
  elif command -v initdb >/dev/null 2>&1; then
    BIN="$(dirname "$(readlink -f "$(command -v initdb)")")"
  else
    BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
    [ -n "$BIN" ] && [ -x "$BIN/initdb" ] \
      || die "PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): apt-get install postgresql (Debian; bash scripts/ensure_test_tools.sh does it), or set RLMILL_PG_BIN to its bin folder"
  fi
  for tool in pg_ctl psql; do
    [ -x "$BIN/$tool" ] || die "$BIN has initdb but no $tool: reinstall PostgreSQL (apt-get install --reinstall postgresql)"
  done
}

find_user() {
  # PostgreSQL refuses to run as root: as root, run it as an unprivileged account (Debian's
  # package creates `postgres`; ensure_test_tools.sh creates it where it is missing).
  AS=()
  if [ "$(id -u)" = 0 ]; then
    PG_USER="${RLMILL_PG_USER:-postgres}"
    id -u "$PG_USER" >/dev/null 2>&1 \
      || die "PostgreSQL refuses to run as root and there is no '$PG_USER' account to run it as: useradd --system --shell /usr/sbin/nologin $PG_USER (bash scripts/ensure_test_tools.sh does it), or set RLMILL_PG_USER"
    local runuser
    runuser="$(PATH="$PATH:/usr/sbin:/sbin" command -v runuser)" \
      || die "runuser is missing (it starts PostgreSQL as '$PG_USER'): apt-get install util-linux"
    AS=("$runuser" -u "$PG_USER" --)
    # A library the caller preloads (vLLM's CPU setup preloads torch's libgomp from the virtual
    # environment, which may sit in a folder closed to that account) cannot be opened by it, and
    # ld.so would print an error on every command it runs: PostgreSQL needs none.
    unset LD_PRELOAD
  fi
}

prepare_dir() {
  mkdir -p "$DIR"
  if [ "${#AS[@]}" -gt 0 ]; then
    chown "$PG_USER" "$DIR"
    "${AS[@]}" test -w "$DIR" \
      || die "the '$PG_USER' account cannot write $DIR (a folder above it is closed to it): set RLMILL_PG_DIR to a folder it can reach, e.g. under /tmp"
  fi
}

pid_of() {  # the postmaster's PID from its PID file, when that process is alive
  local pid
  [ -f "$DATA/postmaster.pid" ] || return 1
  pid="$(head -1 "$DATA/postmaster.pid")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

port_in_use() {  # something accepts connections on 127.0.0.1:$1
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() {
  local py
  py="$(command -v python3 || echo "$REPO/.venv/bin/python")"
  "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

url() {
  [ -f "$DIR/port" ] && [ -f "$DIR/password" ] \
    || die "no cluster in $DIR yet: start one with scripts/postgres_local.sh start (RLMILL_PG_DIR picks the folder)"
  echo "postgresql+asyncpg://$DB_USER:$(cat "$DIR/password")@127.0.0.1:$(cat "$DIR/port")/$DB_NAME"
}

sql() {  # sql DATABASE ARGS...: psql into the running cluster as its superuser
  local db="$1"; shift
  PGPASSWORD="$(cat "$DIR/password")" "$BIN/psql" -X -q -h 127.0.0.1 -p "$(cat "$DIR/port")" -U "$DB_USER" -d "$db" "$@"
}

init_once() {
  [ -f "$DATA/PG_VERSION" ] && return 0
  say "initialising a PostgreSQL cluster in $DIR (once)"
  # The password keeps other local accounts out of a cluster that listens on 127.0.0.1; it
  # lives beside the data, readable only by the cluster's owner (and root).
  (umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/password")
  [ "${#AS[@]}" -eq 0 ] || chown "$PG_USER" "$DIR/password"
  if ! (cd "$DIR" && "${AS[@]}" "$BIN/initdb" -D "$DATA" -U "$DB_USER" --pwfile="$DIR/password" \
        --auth=scram-sha-256 -E UTF8 --no-locale >"$DIR/initdb.log" 2>&1); then
    tail -5 "$DIR/initdb.log" >&2
    rm -rf "$DATA"
    die "initdb failed in $DATA (log above, $DIR/initdb.log)"
  fi
}

start() {
  local pid port
  if pid="$(pid_of)"; then
    port="$(cat "$DIR/port")"
    [ -z "${PGPORT:-}" ] || [ "$PGPORT" = "$port" ] \
      || die "the cluster in $DIR already runs on port $port, not PGPORT=$PGPORT: stop it first (scripts/postgres_local.sh stop), or unset PGPORT"
    say "PostgreSQL already runs on 127.0.0.1:$port, data in $DIR"
    url
    return 0
  fi
  port="${PGPORT:-$(cat "$DIR/port" 2>/dev/null || true)}"
  if [ -z "$port" ] || { [ -z "${PGPORT:-}" ] && port_in_use "$port"; }; then
    port="$(free_port)"  # no port asked for and the last one is taken (or there was none)
  fi
  port_in_use "$port" && die "port $port on 127.0.0.1 is in use (another PostgreSQL?): set PGPORT to a free port, or unset it to pick one"
  init_once
  echo "$port" >"$DIR/port"
  # Unix sockets off: the cluster is reached on 127.0.0.1 only, and a socket path under a long
  # temporary folder can pass the 107-byte limit.
  if ! (cd "$DIR" && "${AS[@]}" "$BIN/pg_ctl" -D "$DATA" -l "$DIR/postgres.log" -w -t 60 \
        -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=''" start >/dev/null); then
    tail -5 "$DIR/postgres.log" >&2 || true
    die "PostgreSQL did not start on port $port (log above, $DIR/postgres.log)"
  fi
  if [ "$(sql postgres -Atc "select 1 from pg_database where datname = '$DB_NAME'")" != 1 ]; then
    sql postgres -c "create database $DB_NAME"
  fi
  say "PostgreSQL $("$BIN/pg_ctl" --version | awk '{print $3}') runs on 127.0.0.1:$port, data in $DIR (stop it: scripts/postgres_local.sh stop)"
  url
}

stop() {
  # By the PID file: SIGINT is PostgreSQL's fast shutdown (clients disconnected, clean
  # checkpoint); SIGQUIT (immediate, recovery at next start) only if it is still there after 30 s.
  local pid sig
  if ! pid="$(pid_of)"; then
    say "no PostgreSQL runs from $DIR"
    return 0
  fi
  for sig in INT QUIT; do
    kill -s "$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do
      kill -0 "$pid" 2>/dev/null || { say "stopped PostgreSQL (pid $pid) of $DIR"; return 0; }
      sleep 0.5
    done
  done
  die "PostgreSQL (pid $pid) of $DIR did not stop after SIGINT and SIGQUIT: kill -9 $pid"
}

case "${1:-}" in
  start) find_bin; find_user; prepare_dir; start ;;
  url) url ;;
  stop) stop ;;
  status)
    if pid="$(pid_of)"; then echo "PostgreSQL (pid $pid) runs from $DIR on port $(cat "$DIR/port")"; else echo "no PostgreSQL runs from $DIR"; exit 3; fi ;;
  psql)
    shift; find_bin
    pid_of >/dev/null || die "no PostgreSQL runs from $DIR: start it with scripts/postgres_local.sh start"
    sql "$DB_NAME" "$@" ;;
  check) find_bin; find_user; echo "$BIN${PG_USER:+ (run as $PG_USER)}" ;;
  *)
    sed -n '2,18p' "$0" >&2
    exit 2 ;;
esac
