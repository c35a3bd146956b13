#!/bin/sh
# Container entry point: bring both schemas up to date, then run the given command (runplatform by default).
# In embedded mode chdb admits one process per data directory, so migrate_clickhouse must finish (it does)
# before the platform starts; runplatform would apply pending ClickHouse migrations itself anyway.
set -eu
cd /app
if [ "${OBSERVATORY_SKIP_MIGRATIONS:-0}" != "1" ]; then
    python manage.py migrate --noinput
    python manage.py migrate_clickhouse
fi
exec "$@"
