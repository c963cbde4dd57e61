#!/bin/sh
# Entry point of every DSpark container: hands the stack's secrets (written into
# $DSPARK_SECRETS_DIR by deploy/init_secrets.py) to the service as its environment, then runs the
# command. Values already set in the environment win.
#   api_keys        one key a line -> DSPARK_SCHEDULER_API_KEYS (comma-separated)
#   redis_password  with DSPARK_REDIS_ADDRESS (host:port) -> DSPARK_SCHEDULER_REDIS_URL
set -eu
dir="${DSPARK_SECRETS_DIR:-/run/dspark-secrets}"
if [ -z "${DSPARK_SCHEDULER_API_KEYS:-}" ] && [ -s "$dir/api_keys" ]; then
  DSPARK_SCHEDULER_API_KEYS="$(grep -v '^[[:space:]]*$' "$dir/api_keys" | tr '\n' ',' | sed 's/,$//')"
  export DSPARK_SCHEDULER_API_KEYS
fi
if [ -z "${DSPARK_SCHEDULER_REDIS_URL:-}" ] && [ -n "${DSPARK_REDIS_ADDRESS:-}" ]; then
  if [ -s "$dir/redis_password" ]; then
    DSPARK_SCHEDULER_REDIS_URL="redis://:$(cat "$dir/redis_password")@${DSPARK_REDIS_ADDRESS}/0"
  else
    DSPARK_SCHEDULER_REDIS_URL="redis://${DSPARK_REDIS_ADDRESS}/0"
  fi
  export DSPARK_SCHEDULER_REDIS_URL
fi
exec "$@"
