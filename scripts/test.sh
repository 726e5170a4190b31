#!/usr/bin/env bash
# Run the test suite (creates .venv and installs the project on first use).
# Extra arguments go to pytest, e.g. scripts/test.sh -k sessions -x
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec python -m pytest "$@"
