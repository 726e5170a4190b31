#!/usr/bin/env bash
# Run the test suite (creates .venv and installs the project on first use).
# Extra arguments go to pytest, e.g. scripts/test.sh -k sessions -x
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
# The HA tests start their own etcd (Debian package etcd-server).
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; } \
      >/tmp/kvmaster-etcd-install.log 2>&1 || { tail -20 /tmp/kvmaster-etcd-install.log >&2; exit 1; }
  else
    echo "etcd is needed by tests/test_ha.py: install the etcd-server package" >&2
  fi
fi
exec python -m pytest "$@"
