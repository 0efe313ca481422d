#!/usr/bin/env bash
# Set up .venv for a CPU machine (CI, laptops): the CPU build of torch first, pinned by a
# constraint for everything after (a bare `torch` requirement would pull a multi-GB CUDA
# build), then every LoongForge package in editable mode. Idempotent; ~2 minutes when fresh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if command -v python3.11 >/dev/null; then PY=python3.11; else PY=python3; fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
echo "[setup] torch (CPU) and triton"
"${PIP[@]}" -r requirements-cpu.txt
echo "[setup] loongforge packages and dev tools"
"${PIP[@]}" -c constraints-cpu.txt -r requirements-dev.txt \
  -e packages/loongforge-core -e packages/loongforge-llm -e packages/loongforge-vlm \
  -e packages/loongforge-diffusion -e packages/loongforge-embodied -e packages/loongforge-xpu \
  -e packages/loongforge-kernels
.venv/bin/python -c "import torch, megatron.core, loongforge.core, loongforge.llm; print('[setup] ok: torch', torch.__version__)"
