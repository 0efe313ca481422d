#!/usr/bin/env bash
# One device call: install the carried wheels (.whl, see docs/benchmarks.md), run the GPU tests,
# then the LLM throughput benchmark; logs go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/packages/loongforge-core/src:$PWD/packages/loongforge-llm/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/llm/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
python3 tools/benchmarks/llm_throughput.py "$@" --json "$OUT/llm_throughput.json" 2>&1 | grep -v -i "warn" | tee "$OUT/llm_throughput.log"
