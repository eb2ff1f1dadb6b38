#!/usr/bin/env bash
# Runs the whole test suite (lint + pytest) against the real SGLang engine on this CPU.
# Creates or tops up .venv first (scripts/setup.sh). Extra arguments go to pytest.
#   scripts/test.sh           the whole suite (what CI runs), in two parts: every test that
#                             starts no real SGLang server, spread over PARALLEL processes
#                             (pytest-xdist, one test module per process at a time); then the
#                             tests marked `server` in SERVER_PARALLEL fixed lanes
#                             (test/server_lanes.py), every process there with one OpenMP
#                             thread, so that no server waits at a barrier for a thread that
#                             the other lane's work descheduled
#   scripts/test.sh --quick   the first part only (-m "not server"); a test that starts a real
#                             server without the mark fails, naming its command
# PARALLEL (default 3): processes of the first part; 1 runs it in this process.
# SERVER_PARALLEL (default 2, at most the lanes' number): processes of the second part; 1 runs
# the lanes one after the other in this process.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PARALLEL=${PARALLEL:-3}
SERVER_PARALLEL=${SERVER_PARALLEL:-2}
for name in PARALLEL SERVER_PARALLEL; do
  case "${!name}" in
    ''|*[!0-9]*|0) echo "test.sh: $name must be a whole number of at least 1, got '${!name}'" >&2
                   exit 2 ;;
  esac
done
bash scripts/setup.sh
export SGLANG_USE_CPU_ENGINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# Bytecode caches (git ignores __pycache__/): without them every pytest process and every
# router, emulator and server the tests start compiles this repository's modules again.
unset PYTHONDONTWRITEBYTECODE
echo "[test] ruff"
.venv/bin/ruff check python test benchmark scripts sgl-kernel-npu
QUICK=0
if [ "${1:-}" = "--quick" ]; then
  shift
  QUICK=1
fi
SPREAD=()
if [ "$PARALLEL" -gt 1 ]; then
  SPREAD=(-n "$PARALLEL" --dist loadscope)
fi

# pytest's status 5 (no test selected) is not a failure here: arguments may select one part only
run_part() {
  local status=0
  "$@" || status=$?
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
    exit "$status"
  fi
}

echo "[test] pytest: tests without a real server (${PARALLEL} processes)"
OMNIINFER_TEST_QUICK=1 run_part .venv/bin/python -m pytest -m "not server" "${SPREAD[@]}" "$@"
if [ "$QUICK" = 1 ]; then
  exit 0
fi
LANES=()
if [ "$SERVER_PARALLEL" -gt 1 ]; then
  LANES=(-n "$SERVER_PARALLEL" --dist loadscope)
fi
echo "[test] pytest: tests with real servers (${SERVER_PARALLEL} lanes)"
OMNIINFER_TEST_SERVER_LANES=1 run_part .venv/bin/python -m pytest -m server "${LANES[@]}" "$@"
