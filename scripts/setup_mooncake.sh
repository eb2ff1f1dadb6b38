#!/usr/bin/env bash
# Installs Mooncake's transfer engine (the host-memory build) into the given venv so that SGLang's
# `--disaggregation-transfer-backend mooncake_tcp` works on a CPU machine, without root.
#
# The PyPI wheel loads libibverbs.so.1 (and through it libnl-3 / libnl-route-3) at import time,
# even for the TCP transport. Debian ships them; their .deb files are unpacked and the libraries
# placed next to the wheel's engine.so, whose RPATH starts with $ORIGIN. An existing Mooncake
# that already imports (a GPU or NPU machine's own build) is left alone.
# Usage: scripts/setup_mooncake.sh VENV_PYTHON
set -euo pipefail
PY="$1"
MOONCAKE_VERSION="0.3.13.post1"
DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
LIBS=(libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200)

engine_imports() {
  "$PY" -c "from mooncake.engine import TransferEngine" >/dev/null 2>&1
}

if engine_imports; then
  echo "[setup] mooncake transfer engine: present"
  exit 0
fi

if ! "$PY" -c "import mooncake" >/dev/null 2>&1; then
  echo "[setup] mooncake transfer engine $MOONCAKE_VERSION (host-memory build)"
  "$PY" -m pip --disable-pip-version-check -q install --no-deps --no-warn-conflicts \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi

PKG_DIR=$("$PY" -c "import mooncake, os; print(os.path.dirname(mooncake.__file__))")
missing=()
for lib in "${LIBS[@]}"; do
  if [ ! -e "$PKG_DIR/$lib" ] && ! ldconfig -p 2>/dev/null | grep -q "$lib "; then
    missing+=("$lib")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "[setup] native libraries for mooncake: ${missing[*]} (from Debian packages, unpacked)"
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs" "$WORK/root"
  APT_OPTS=(-o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache" -o "Debug::NoLocking=1")
  if ! apt-get "${APT_OPTS[@]}" -qq update >"$WORK/apt.log" 2>&1 \
     || ! (cd "$WORK/debs" && apt-get "${APT_OPTS[@]}" -qq download "${DEBS[@]}" >>"$WORK/apt.log" 2>&1); then
    cat "$WORK/apt.log" >&2
    echo "[setup] error: could not download ${DEBS[*]} from Debian" >&2
    exit 1
  fi
  for deb in "$WORK"/debs/*.deb; do
    dpkg -x "$deb" "$WORK/root"
  done
  for lib in "${LIBS[@]}"; do
    found=$(find "$WORK/root" -name "$lib" | head -n1)
    if [ -z "$found" ]; then
      echo "[setup] error: $lib not found in ${DEBS[*]}" >&2
      exit 1
    fi
    cp -L "$found" "$PKG_DIR/$lib"
  done
fi

if ! engine_imports; then
  echo "[setup] error: mooncake.engine does not import; missing libraries:" >&2
  ldd "$PKG_DIR/engine.so" | grep "not found" >&2 || true
  exit 1
fi
echo "[setup] mooncake transfer engine: ready"
