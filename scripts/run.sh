#!/usr/bin/env bash
# The main job: start a master, replay a seeded multi-turn workload through
# worker processes with real shared-memory payloads, print hit rate and
# latencies (creates .venv and installs the project on first use).
# Extra arguments go to `kvmaster-loadgen synthetic`, e.g. scripts/run.sh --requests 5000
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$ROOT"
exec kvmaster-loadgen synthetic --requests 2000 --workers 2 --json results/demo.json "$@"
