#!/usr/bin/env bash
# One device call: install the carried wheels (.whl, see docs/benchmarks.md), then run the parts
# named in $PARTS (default: all) with their logs in $OUT:
#   tests   GPU tests (tests/llm/test_gpu.py, tests/kernels/test_kernels_gpu.py)
#   kerneltests  GPU tests of the kernels only (tests/kernels/test_kernels_gpu.py; $KERNEL_K: pytest -k)
#   kernels tools/benchmarks/kernels.py
#   sft     tools/benchmarks/sft_throughput.py
#   llm     tools/benchmarks/llm_throughput.py ($LLM_ARGS; $LLM_SETUPS: comma-separated setup names; $LLM_TIMEOUT s, default 400)
#   profile tools/benchmarks/profile_step.py ($PROFILE_ARGS)
#   ckpt    tools/benchmarks/checkpoint_save.py (the 1.3B checkpoint save with and without the commit's fsyncs)
#   compare tools/benchmarks/compare_trees.py: $LLM_SETUPS on this tree against the source tree in
#           $OTHER_TREE, alternating fresh processes, $ROUNDS rounds (default 3; $COMPARE_ARGS)
#   embodied  GPU tests of embodied training and inference (tests/embodied/test_pi_gpu.py, tests/core/test_cuda_graph.py; $EMBODIED_K: pytest -k)
#   oracle    tools/oracles/pi_vs_lerobot.py on the GPU, pi05 and pi0 (LeRobot's wheels in $LR_SITE)
#   vla       tools/benchmarks/vla_throughput.py ($VLA_ARGS; $VLA_TIMEOUT s, default 540)
#   moetests  GPU tests of the MoE stack (tests/llm/test_moe_gpu.py)
#   moe       tools/benchmarks/moe_throughput.py ($MOE_ARGS; $MOE_SETUPS: comma-separated setup names; $MOE_TIMEOUT s, default 480)
#   wantests  GPU tests of the Wan stack (tests/diffusion/test_wan_gpu.py)
#   diffusion tools/benchmarks/diffusion_throughput.py ($DIFF_ARGS; $DIFF_SETUPS; $DIFF_TIMEOUT s, default 480)
#   vlmtests  GPU tests of the VLM stack (tests/vlm/test_vlm_gpu.py, and test_vlm_model.py on the GPU image's transformers)
#   vlm       tools/benchmarks/vlm_throughput.py ($VLM_ARGS; $VLM_SETUPS; $VLM_TIMEOUT s, default 480)
# $SITE (default /tmp/site) is where the wheels in .whl go; a later call on the same warm machine
# may carry none (SKIP_INSTALL=1) or others. LeRobot's set goes to $LR_SITE (its own
# transformers): .whl_lr, installed when present.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
PARTS="${PARTS:-tests kernels llm sft}"
export SITE="${SITE:-/tmp/site}"; LR_SITE="${LR_SITE:-/tmp/site_lr}"
if [ -z "${SKIP_INSTALL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
if ls .whl_lr/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$LR_SITE" .whl_lr/*.whl || exit 1
fi
src=$PWD/packages
export PYTHONPATH=$SITE:$src/loongforge-core/src:$src/loongforge-llm/src:$src/loongforge-kernels/src:$src/loongforge-embodied/src:$src/loongforge-diffusion/src:$src/loongforge-vlm/src
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# entry points come from installed distributions: register the source trees' packages as such
python3 - <<'PY'
import pathlib, site
import os
root = pathlib.Path(os.environ["SITE"])
root.mkdir(parents=True, exist_ok=True)
for name, ep in (("loongforge_core", "core = loongforge.core.plugin:register"), ("loongforge_llm", "llm = loongforge.llm.plugin:register"),
                 ("loongforge_kernels", "kernels = loongforge.kernels.plugin:register"),
                 ("loongforge_embodied", "embodied = loongforge.embodied.plugin:register"),
                 ("loongforge_diffusion", "diffusion = loongforge.diffusion.plugin:register"),
                 ("loongforge_vlm", "vlm = loongforge.vlm.plugin:register")):
    d = root / f"{name}-0.1.0.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text(f"[loongforge.plugins]\n{ep}\n")
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__, 'megatron-core', m.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "from loongforge.core.registry import registry; print('ops:', registry().names('op'))" | tee -a "$OUT/gpu.txt"
for part in $PARTS; do
  case $part in
    tests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/llm/test_gpu.py tests/kernels/test_kernels_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log" ;;
    kerneltests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernels_gpu.py ${KERNEL_K:+-k "$KERNEL_K"} 2>&1 | tail -20 | tee "$OUT/kernel_tests.log" ;;
    kernels) timeout 500 python3 tools/benchmarks/kernels.py ${KERNEL_ARGS:-} --json "$OUT/kernels.json" 2>&1 | grep -v -i "warn" | tee "$OUT/kernels.log" ;;
    sft) timeout 240 python3 tools/benchmarks/sft_throughput.py --json "$OUT/sft_throughput.json" 2>&1 | grep -v -i "warn" | tee "$OUT/sft_throughput.log" ;;
    profile) timeout 200 python3 tools/benchmarks/profile_step.py ${PROFILE_ARGS:-} 2>&1 | grep -v -i "warn" | tee "$OUT/profile_step.log" ;;
    ckpt) timeout ${CKPT_TIMEOUT:-400} python3 tools/benchmarks/checkpoint_save.py ${CKPT_ARGS:-} 2>&1 | grep -v -i "warn" | tee "$OUT/checkpoint_save.log" ;;
    compare) timeout ${COMPARE_TIMEOUT:-500} python3 tools/benchmarks/compare_trees.py --other "$OTHER_TREE" --setups "$LLM_SETUPS" --rounds ${ROUNDS:-3} ${COMPARE_ARGS:-} 2>&1 | grep -v -i "warn" | tee "$OUT/compare_trees.log" ;;
    embodied) timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/embodied/test_pi_gpu.py tests/core/test_cuda_graph.py ${EMBODIED_K:+-k "$EMBODIED_K"} 2>&1 | tail -40 | tee "$OUT/embodied_gpu_tests.log" ;;
    oracle) for v in pi05 pi0; do timeout 200 python3 tools/oracles/pi_vs_lerobot.py --site "$LR_SITE" --device cuda --variant $v 2>&1 | grep -v -i "warn" | tail -12; done | tee "$OUT/pi_oracle.log" ;;
    vla) timeout ${VLA_TIMEOUT:-540} python3 tools/benchmarks/vla_throughput.py --site "$LR_SITE" ${VLA_ARGS:-} 2>&1 | grep -v -i "warn" | tee "$OUT/vla_throughput.log" ;;
    moetests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/llm/test_moe_gpu.py 2>&1 | tail -40 | tee "$OUT/moe_gpu_tests.log" ;;
    moe) timeout ${MOE_TIMEOUT:-480} python3 tools/benchmarks/moe_throughput.py ${MOE_ARGS:-} ${MOE_SETUPS:+--setups "$MOE_SETUPS"} --json "$OUT/moe_throughput.json" 2>&1 | grep -v -i "warn" | tee "$OUT/moe_throughput.log" ;;
    wantests) timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/diffusion/test_wan_gpu.py 2>&1 | tail -40 | tee "$OUT/wan_gpu_tests.log" ;;
    diffusion) timeout ${DIFF_TIMEOUT:-480} python3 tools/benchmarks/diffusion_throughput.py ${DIFF_ARGS:-} ${DIFF_SETUPS:+--setups "$DIFF_SETUPS"} --json "$OUT/diffusion_throughput.json" 2>&1 | grep -v -i "warn" | tee "$OUT/diffusion_throughput.log" ;;
    vlmtests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/vlm/test_vlm_model.py tests/vlm/test_vlm_gpu.py 2>&1 | tail -40 | tee "$OUT/vlm_tests.log" ;;
    vlm) timeout ${VLM_TIMEOUT:-480} python3 tools/benchmarks/vlm_throughput.py ${VLM_ARGS:-} ${VLM_SETUPS:+--setups "$VLM_SETUPS"} --json "$OUT/vlm_throughput.json" 2>&1 | grep -v -i "warn" | tee "$OUT/vlm_throughput.log" ;;
    llm) timeout ${LLM_TIMEOUT:-400} python3 tools/benchmarks/llm_throughput.py ${LLM_ARGS:-} ${LLM_SETUPS:+--setups "$LLM_SETUPS"} --json "$OUT/llm_throughput.json" 2>&1 | grep -v -i "warn" | tee "$OUT/llm_throughput.log" ;;
  esac
done
