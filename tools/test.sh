#!/usr/bin/env bash
# Set up (tools/setup.sh), then run the whole test suite on the CPU. Extra arguments go to pytest.
# Tests run in $LOONGFORGE_TEST_WORKERS pytest-xdist workers (default 2), a test file per worker
# (its module fixtures built once); 1 runs them in this process. With several workers each process
# (workers and the CLIs the tests start) runs torch on one thread ($OMP_NUM_THREADS, unless set):
# the tests' tiny models gain nothing from a second thread, and idle threads spinning beside the
# other worker's processes slowed a test up to threefold.
# The CLIs the tests run are forked from a server process per pytest process that has torch,
# megatron-core and transformers imported (tests/cli_forkserver.py: ~10 s of CPU less per CLI run);
# it is used where a child equals a fresh interpreter (one torch thread, the same environment, no GPU);
# LOONGFORGE_TEST_FORKSERVER=0 starts every CLI as a fresh interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
export LOONGFORGE_DEVICE="${LOONGFORGE_DEVICE:-cpu}" TRITON_INTERPRET=1
workers="${LOONGFORGE_TEST_WORKERS:-2}"
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  .venv/bin/python -m pytest tests -n "$workers" --dist loadfile --durations=25 "$@"
else
  .venv/bin/python -m pytest tests --durations=25 "$@"
fi
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
