#!/usr/bin/env bash
# Runs the whole test suite (lint + pytest) against the real SGLang engine on this CPU.
# Creates or tops up .venv first (scripts/setup.sh). Extra arguments go to pytest.
#   scripts/test.sh           the whole suite (what CI runs)
#   scripts/test.sh --quick   every test that starts no real SGLang server (-m "not server");
#                             one that does without the mark fails, naming its command
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
export SGLANG_USE_CPU_ENGINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
echo "[test] ruff"
.venv/bin/ruff check python test benchmark scripts sgl-kernel-npu
QUICK=()
if [ "${1:-}" = "--quick" ]; then
  shift
  export OMNIINFER_TEST_QUICK=1
  QUICK=(-m "not server")
fi
echo "[test] pytest"
exec .venv/bin/python -m pytest "${QUICK[@]}" "$@"
