#!/usr/bin/env bash
# Runs the whole test suite (lint + pytest) against the real SGLang engine on this CPU.
# Creates or tops up .venv first (scripts/setup.sh). Extra arguments go to pytest.
#   scripts/test.sh           the whole suite (what CI runs), in two parts: every test that
#                             starts no real SGLang server, spread over PARALLEL processes
#                             (pytest-xdist, one test module per process at a time); then the
#                             tests marked `server`, one at a time (a real server's OpenMP
#                             threads slow several-fold when any other CPU job shares the cores)
#   scripts/test.sh --quick   the first part only (-m "not server"); a test that starts a real
#                             server without the mark fails, naming its command
# PARALLEL (default 3): processes of the first part; 1 runs it in this process.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PARALLEL=${PARALLEL:-3}
case "$PARALLEL" in
  ''|*[!0-9]*) echo "test.sh: PARALLEL must be a whole number, got '$PARALLEL'" >&2; exit 2 ;;
esac
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
echo "[test] pytest: tests with real servers"
run_part .venv/bin/python -m pytest -m server "$@"
