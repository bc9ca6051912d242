#!/usr/bin/env bash
# A private PostgreSQL server for the audit service's tests (crates/engy-audit/tests/serve.rs),
# from Debian's package (`apt-get install postgresql`; binaries under
# /usr/lib/postgresql/*/bin), on 127.0.0.1 only, its data and socket in DIR, trust auth.
#
#   tests/postgres.sh start PORT DIR     initdb (once) + start; prints the URL on stdout
#   tests/postgres.sh restart DIR        stop (fast) and start again, same port and data
#   tests/postgres.sh stop DIR           stop
#
# As root the server runs as the package's `postgres` user (initdb refuses root); DIR is
# created for it. The URL is postgres://postgres@127.0.0.1:PORT/engy_test.
set -euo pipefail

say() { echo "[tests/postgres.sh] $*" >&2; }

BIN="${ENGY_POSTGRES_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}"
if [ -z "$BIN" ] || [ ! -x "$BIN/pg_ctl" ]; then
  say "no PostgreSQL binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)"
  exit 1
fi

as_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

cmd="${1:-}"
case "$cmd" in
  start)
    PORT="$2"
    DIR="$3"
    mkdir -p "$DIR"
    if [ "$(id -u)" = 0 ]; then
      chown postgres "$DIR"
      # The server (user postgres) must reach DIR through its parents.
      d="$DIR"
      while [ "$d" != "/" ]; do
        d="$(dirname "$d")"
        chmod o+x "$d" 2>/dev/null || true
      done
    fi
    if [ ! -f "$DIR/data/PG_VERSION" ]; then
      as_pg "$BIN/initdb" -D "$DIR/data" -A trust -U postgres --no-sync >/dev/null
    fi
    echo "$PORT" >"$DIR/port"
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/log" -w -t 60 \
      -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
    as_pg "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = 'engy_test'" | grep -q 1 ||
      as_pg "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres engy_test
    echo "postgres://postgres@127.0.0.1:$PORT/engy_test"
    ;;
  restart)
    DIR="$2"
    PORT="$(cat "$DIR/port")"
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/log" -w -t 60 -m fast \
      -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1 -c fsync=off" restart >/dev/null
    ;;
  stop)
    DIR="$2"
    as_pg "$BIN/pg_ctl" -D "$DIR/data" -w -t 60 -m fast stop >/dev/null || true
    ;;
  *)
    say "usage: $0 start PORT DIR | restart DIR | stop DIR"
    exit 2
    ;;
esac
