#!/usr/bin/env bash
# The deployment this project is for, on the embedded default model: one prefill and one decode
# real SGLang server on this CPU (SmolLM2-135M, the omniinfer plugin, the OmniAttn pattern on
# both, KV over Mooncake TCP), OmniProxy with OAS in front in PD mode, one chat answer, a short
# closed-loop benchmark table and a line per technique; then OmniPlacement under PD on a Qwen3-MoE
# pair with expert parallelism. Every process it starts is stopped at the end. Extra arguments go
# to `python -m omniinfer.demo` (--pattern none, --no-placement).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
export SGLANG_USE_CPU_ENGINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec .venv/bin/python -m omniinfer.demo --model .cache/models/SmolLM2-135M-Instruct "$@"
