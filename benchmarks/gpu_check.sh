#!/usr/bin/env bash
# Prepared GPU check of the fused prefill kernel, for a CUDA machine; about 4-5 minutes on an H200.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# 1. the kernel tests (tests/jrt_kernels: forward, fused backward, decay/gate, safe fallback), compiled, not
#    interpreted: fp32/bf16/fp16 against the fp64 oracle, and bf16 at 4k tokens against the fp32 PyTorch path (one
#    kernel config, JRT_TRITON_AUTOTUNE=0, so compiling stays short);
# 2. the prefill benchmark at the paper's shapes (B=16, H=16, K=16, V=64, M=N/2, bf16, N=1k..32k; B=2..64 at 16k),
#    autotuned, then B=1 at 32k with the deployed prefix M=1024.
# Optionally (JRT_GPU_CHECK_PTXAS=1) step 4 below: the backward with ptxas's register allocator at its own level.
# Writes OUT_DIR/env.txt, tests.txt, prefill.txt, prefill.json, prefill_b1.txt, prefill_b1.json, summary.txt (and
# ptxas.txt, ptxas.json).
# Needs torch with CUDA, triton and transformers>=5.24 (modeling_jrt). Wheels found in .whl/ (e.g. a newer
# transformers, or fla-core for the fla columns) are installed to a temporary folder first; nothing is installed
# system-wide. Run from anywhere; paths are relative to the repository root. For a machine whose transformers is
# older and which cannot reach PyPI, fetch the wheel beforehand, on a machine that can:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
set -uo pipefail

out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=8 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

site=$(mktemp -d /tmp/jrt-gpu-check.XXXXXX)
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        || echo "warning: could not install the wheels in .whl/" >&2
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$python" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    "$python" -c "import modeling_jrt, jrt_kernels; print('modeling_jrt and jrt_kernels import')"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if ! "$python" -c "import modeling_jrt, jrt_kernels" > /dev/null 2>&1; then
    echo "modeling_jrt or jrt_kernels does not import (see env.txt): transformers>=5.24 is needed; put its wheel" \
        "in .whl/ (header of this script)" | tee "$out/summary.txt"
    exit 3
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: this script is for a GPU machine (CPU tests: pytest tests/jrt_kernels)" | tee "$out/summary.txt"
    exit 2
fi

echo "== 1. compiled kernel tests" | tee "$out/tests.txt"
JRT_TRITON_AUTOTUNE=0 timeout 170 "$python" -m pytest -q -p no:cacheprovider -o addopts="" tests/jrt_kernels \
    2>&1 | tee -a "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== 2. prefill benchmark (paper shapes)" | tee "$out/prefill.txt"
timeout 240 "$python" benchmarks/prefill.py --batch-sweep --train-step --repeats 10 --warmup 3 \
    --json "$out/prefill.json" \
    2>&1 | tee -a "$out/prefill.txt"
bench_rc=${PIPESTATUS[0]}

echo "== 3. B=1, N=32k, deployed prefix M=1024" | tee "$out/prefill_b1.txt"
timeout 60 "$python" benchmarks/prefill.py --batch 1 --seq-lens 32768 --prefix 1024 --no-quadratic --repeats 10 \
    --json "$out/prefill_b1.json" 2>&1 | tee -a "$out/prefill_b1.txt"
b1_rc=${PIPESTATUS[0]}

# 4. (optional, JRT_GPU_CHECK_PTXAS=1, about 2 more minutes) triton runs ptxas with --regAllocOptLevel=2, a workaround
#    for a ptxas 13.x bug it does not name; without it the sm_90 dq scan builds spill-free (docs/kernels.md, backward
#    pass 9). Triton's PTXAS_OPTIONS comes after that flag, and ptxas takes the last value: level 4 built like ptxas's
#    own default for every kernel here. The compiled backward tests and the paper-shape benchmark at 32k, with it.
ptxas_rc=0
if [ "${JRT_GPU_CHECK_PTXAS:-0}" = "1" ]; then
    echo "== 4. backward tests and 32k benchmark with PTXAS_OPTIONS=--regAllocOptLevel=4" | tee "$out/ptxas.txt"
    PTXAS_OPTIONS=--regAllocOptLevel=4 JRT_TRITON_AUTOTUNE=0 timeout 120 "$python" -m pytest -q -p no:cacheprovider \
        -o addopts="" tests/jrt_kernels/test_prefix_linear_attention_backward.py 2>&1 | tee -a "$out/ptxas.txt"
    ptxas_rc=${PIPESTATUS[0]}
    PTXAS_OPTIONS=--regAllocOptLevel=4 timeout 90 "$python" benchmarks/prefill.py --seq-lens 32768 --train-step \
        --repeats 10 --warmup 3 --json "$out/ptxas.json" 2>&1 | tee -a "$out/ptxas.txt"
    ptxas_bench_rc=${PIPESTATUS[0]}
    [ "$ptxas_rc" -eq 0 ] && ptxas_rc=$ptxas_bench_rc
fi

echo "tests rc=$tests_rc, benchmark rc=$bench_rc, B=1 benchmark rc=$b1_rc, ptxas step rc=$ptxas_rc" \
    | tee "$out/summary.txt"
rm -rf "$site"
exit $((tests_rc != 0 || bench_rc != 0 || b1_rc != 0 || ptxas_rc != 0))
