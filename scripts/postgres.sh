#!/usr/bin/env bash
# A PostgreSQL server on loopback for the ledger tests and the bench; prints the storage URL.
#
#     url=$(bash scripts/postgres.sh)          # postgresql+psycopg2://sweep@127.0.0.1:55432/sweep
#     bash scripts/postgres.sh stop            # stop it (the data directory stays)
#
# Idempotent: installs Debian's postgresql (apt-get --no-install-recommends) only if no PostgreSQL
# server is installed, creates the data directory only once, starts the server only if it is not
# running, creates the role and database only if missing. Debian's own cluster (port 5432) is left
# alone: ours has its own data directory, port and socket directory.
#
# No password anywhere: the server accepts the role without one, and only from 127.0.0.1 and its
# own socket (trust on loopback). That is for a test server on one machine; a shared server takes
# a password through PGPASSWORD or ${oc.env:...} (docs/cluster.md).
#
# Settings (environment): SWEEP_PG_PORT (55432), SWEEP_PG_DIR (/tmp/dit-sweep-postgres),
# SWEEP_PG_USER (sweep), SWEEP_PG_DB (sweep). Progress goes to stderr, the URL alone to stdout.
set -euo pipefail

PORT=${SWEEP_PG_PORT:-55432}
DIR=${SWEEP_PG_DIR:-/tmp/dit-sweep-postgres}
ROLE=${SWEEP_PG_USER:-sweep}
DB=${SWEEP_PG_DB:-sweep}
say() { echo "postgres.sh: $*" >&2; }

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

BIN=$(find_bin)
if [[ -z "$BIN" || ! -x "$BIN/initdb" ]]; then
    say "installing Debian's postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends postgresql >/dev/null; }
    BIN=$(find_bin)
fi

# The server refuses to run as root: as root it runs as the postgres user Debian's package created.
if [[ $(id -u) -eq 0 ]]; then
    as_owner() { runuser -u postgres -- "$@"; }
else
    as_owner() { "$@"; }
fi
pg() { as_owner "$BIN/$1" "${@:2}"; }

if [[ "${1:-start}" == "stop" ]]; then
    [[ -f "$DIR/data/PG_VERSION" ]] && pg pg_ctl -D "$DIR/data" -m fast stop >&2 || true
    exit 0
fi

if [[ ! -f "$DIR/data/PG_VERSION" ]]; then
    say "initdb $DIR/data"
    mkdir -p "$DIR"
    [[ $(id -u) -eq 0 ]] && chown postgres:postgres "$DIR"
    chmod 700 "$DIR"
    pg initdb -D "$DIR/data" -U postgres --auth-local=trust --auth-host=trust -E UTF8 --locale=C.UTF-8 >/dev/null
fi

if ! pg pg_ctl -D "$DIR/data" status >/dev/null 2>&1; then
    say "starting on 127.0.0.1:$PORT"
    pg pg_ctl -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
        -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
fi

psql_() { pg psql -h "$DIR" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA "$@"; }
if [[ -z $(psql_ -c "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'") ]]; then
    psql_ -c "CREATE ROLE \"$ROLE\" LOGIN"
fi
if [[ -z $(psql_ -c "SELECT 1 FROM pg_database WHERE datname = '$DB'") ]]; then
    psql_ -c "CREATE DATABASE \"$DB\" OWNER \"$ROLE\""
fi

echo "postgresql+psycopg2://$ROLE@127.0.0.1:$PORT/$DB"
