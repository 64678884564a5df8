#!/usr/bin/env bash
# `make serve`'s broker and secrets: a redis-server on 127.0.0.1:PORT that asks for a password,
# and the key serve signs its events with. Generated once, kept across runs, readable by their
# owner only (0600):
#   DIR/redis.password   the password (RLMILL_REDIS_PASSWORD_FILE=DIR/redis.password, or its text as
#                        RLMILL_REDIS_PASSWORD, for serve and every consumer)
#   DIR/redis.conf       its config: the ACL (default user: that password, keys rlmill:* only, no
#                        @dangerous commands such as FLUSHALL, CONFIG, DEBUG), bound to 127.0.0.1
#   DIR/event.key        the event-signing key (RLMILL_EVENT_KEY_FILE; gpu_jobs/online/signing.py)
# The password goes in a config file, not on redis-server's command line, where `ps` shows it.
#
#   bash scripts/serve_redis.sh PORT DIR PYTHON
set -euo pipefail
port=$1 dir=$2 py=$3
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
umask 077
[ -s "$dir/redis.password" ] || head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/redis.password"
"$py" -m gpu_jobs.online.signing new "$dir/event.key" >/dev/null
pw=$(cat "$dir/redis.password")
hint() {
    echo "[rlmill] consumers: export RLMILL_REDIS_PASSWORD_FILE=$dir/redis.password RLMILL_EVENT_KEY_FILE=$dir/event.key"
}
if REDISCLI_AUTH="$pw" redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then
    hint  # ours, from an earlier make serve
    exit 0
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "make serve: something on 127.0.0.1:$port does not take the password in $dir/redis.password (a redis-server" \
         "an older make serve started without one?): stop it (kill \$(cat $dir/redis.pid)), or make serve REDIS_PORT=<free port>"
    exit 1
fi
command -v redis-server >/dev/null || {
    echo "make serve: redis-server is not installed: apt-get install redis-server, or make serve REDIS=none"; exit 1; }
cat > "$dir/redis.conf" <<EOF
bind 127.0.0.1
port $port
protected-mode yes
save ""
daemonize yes
pidfile $dir/redis.pid
logfile $dir/redis.log
user default on >$pw ~rlmill:* &* +@all -@dangerous
EOF
redis-server "$dir/redis.conf"
for _ in $(seq 50); do
    REDISCLI_AUTH="$pw" redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break
    sleep 0.1
done
echo "[rlmill] started redis-server on 127.0.0.1:$port with the password in $dir/redis.password (stop it: kill \$(cat $dir/redis.pid))"
hint
