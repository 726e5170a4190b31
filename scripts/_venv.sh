# Sourced by run.sh and test.sh: create .venv if missing and install the project.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
stamp="$ROOT/.venv/.kvmaster-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  "$ROOT/.venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$ROOT/.venv/bin/python" -m pip install -q -e "$ROOT[dev]"
  touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
