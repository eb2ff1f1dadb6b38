#!/usr/bin/env bash
# The whole system this project is for, on this CPU: deploy/omni-1p1d-cpu.yaml started as
# `omniinfer deploy` starts it (one prefill and one decode real SGLang server on SmolLM2-MoE,
# two expert-parallel ranks each, the OmniAttn pattern and OmniPlacement on both, KV over
# Mooncake TCP, OmniProxy with OAS in front in PD mode), one chat answer, a short closed-loop
# benchmark table and a line per technique. Every process it starts is stopped at the end.
# Extra arguments go to `python -m omniinfer.testbed.demo` (--deployment FILE,
# --num-requests N, ...).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
export SGLANG_USE_CPU_ENGINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec .venv/bin/python -m omniinfer.testbed.demo "$@"
