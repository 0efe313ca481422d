#!/usr/bin/env bash
# Set up (tools/setup.sh), then run the whole test suite on the CPU. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
export LOONGFORGE_DEVICE="${LOONGFORGE_DEVICE:-cpu}" TRITON_INTERPRET=1
.venv/bin/python -m pytest tests --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
