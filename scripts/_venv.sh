# Sourced by run.sh and test.sh: create .venv if missing and install the project.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
stamp="$ROOT/.venv/.kvmaster-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  log="$ROOT/.venv/install.log"
  echo "installing kvmaster into $ROOT/.venv (first run only, a minute or two: torch is one of the test dependencies)..." >&2
  if ! { "$ROOT/.venv/bin/python" -m pip install --upgrade pip &&
         "$ROOT/.venv/bin/python" -m pip install -e "$ROOT[dev,engines]"; } >"$log" 2>&1; then
    tail -40 "$log" >&2; echo "installing kvmaster failed; full log: $log" >&2; exit 1
  fi
  touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
