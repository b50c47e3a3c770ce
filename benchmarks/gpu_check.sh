#!/usr/bin/env bash
# Prepared GPU check of the kernels and the model's GPU paths, for a CUDA machine; at most 8 minutes (each step has its
# own time limit), usually less on an H200.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# 1. the kernel tests (tests/jrt_kernels: prefill forward, fused backward, decay/gate, safe fallback, the serving
#    decode step at pool slots), compiled, not interpreted: fp32/bf16/fp16 against the fp64 oracle and the PyTorch
#    paths (one kernel config, JRT_TRITON_AUTOTUNE=0, so compiling stays short; 16 pytest workers with pytest-xdist);
# 2. benchmarks/gpu_model_check.py: each model kind (JRT-RNN's three fills, Based with decay) on the GPU against the
#    CPU (forward, greedy generate(), the JRT objective's gradients, bf16) and the decode step at slots replayed
#    from a CUDA graph;
# 3. the prefill benchmark at the paper's shapes (B=16, H=16, K=16, V=64, M=N/2, bf16, N=2k-32k, forward and forward
#    + backward against flash SDPA and fla, and a training step), the kernel tuned ahead of time in an untimed pass
#    (its picks in triton's cache); 4. B=1 at 32k with the deployed prefix M=1024 (one row's segments);
# 5. whole-model prefill, JRT-RNN against a same-size Llama, bf16, batch 1 and 8, 2k-32k (benchmarks/model_prefill.py);
# 6. decode per token through generate(), both models' default (eager) call and their compiled path
#    (`cache_implementation="static"`), bf16, 16 sequences at 2k-32k: the benchmark model (hidden 256, 8 layers), then
#    the released 360M shape (hidden 1024, 26 layers, random weights) at 2k and 8k (benchmarks/decode.py --generate);
# 7. kernel launches of an eager decode step and of a 4k prefill, both models (benchmarks/launches.py, torch.profiler);
# 8. a training step's tokens/s, both models (benchmarks/train_step.py); 9. vLLM throughput, both models as vLLM runs
#    them by default (compiled; CUDA graphs, piecewise for JRT-RNN: docs/serving.md), at 2k-token prompts
#    (benchmarks/serve.py; only where vllm imports).
# Optionally (JRT_GPU_CHECK_PTXAS=1) step 10 below: the backward with ptxas's register allocator at its own level.
# Writes OUT_DIR/env.txt, tests.txt, model.txt, prefill.txt, prefill.json, prefill_b1.txt, prefill_b1.json,
# model_prefill.txt, model_prefill_b1.json, model_prefill_b8.json, decode.txt, launches.txt, launches.json,
# train.txt, serve.txt (serve.json), summary.txt (and ptxas.txt, ptxas.json).
# Needs torch with CUDA, triton and a transformers release pyproject declares (>=5.5). Wheels found in .whl/ (e.g.
# fla-core for the fla columns, or another transformers) are installed to a temporary folder first; nothing is
# installed system-wide. Run from anywhere; paths are relative to the repository root. For a machine which cannot
# reach PyPI, fetch the wheels beforehand, on a machine that can:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl fla-core
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
    echo "modeling_jrt or jrt_kernels does not import (see env.txt): a transformers release pyproject declares is" \
        "needed; put its wheel in .whl/ (header of this script)" | tee "$out/summary.txt"
    exit 3
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: this script is for a GPU machine (CPU tests: pytest tests/jrt_kernels)" | tee "$out/summary.txt"
    exit 2
fi

# Each step has its own time limit (seconds, 480 in all; usually less), so that one step that hangs leaves the others
# their turn.
workers=""
"$python" -c "import xdist" > /dev/null 2>&1 && workers="-n 16"  # triton compiles on the CPU: a process per core

# -v: each test's verdict is in tests.txt as it finishes (a step stopped at its time limit still names its failures);
# the console shows the failures and the tally.
echo "== 1. compiled kernel tests" | tee "$out/tests.txt"
JRT_TRITON_AUTOTUNE=0 timeout 80 "$python" -m pytest -v --tb=short -p no:cacheprovider -o addopts="" $workers \
    tests/jrt_kernels 2>&1 | tee -a "$out/tests.txt" | grep -E "FAILED|ERROR|Error:|^E |passed|failed"
tests_rc=${PIPESTATUS[0]}

echo "== 2. whole-model checks: the GPU paths against the CPU (benchmarks/gpu_model_check.py)" | tee "$out/model.txt"
JRT_TRITON_AUTOTUNE=0 timeout 50 "$python" benchmarks/gpu_model_check.py 2>&1 | tee -a "$out/model.txt"
model_rc=${PIPESTATUS[0]}

echo "== 3. prefill benchmark (paper shapes: B=16, H=16, M=N/2, bf16, N=2k-32k, forward and backward)" \
    | tee "$out/prefill.txt"
# 3a. Tuning ahead of time: one untimed call per shape class autotunes the kernel and writes each pick to triton's
#     cache; 3b then times every N in one step with nothing left to tune.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$out/triton-cache}"
timeout 45 "$python" benchmarks/prefill.py --seq-lens 2048 8192 32768 --repeats 1 --warmup 1 --no-quadratic \
    --no-chunked --no-fla 2>&1 | tail -n 3 | sed 's/^/tuning: /' | tee -a "$out/prefill.txt"
timeout 40 "$python" benchmarks/prefill.py --seq-lens 2048 8192 32768 --train-step --repeats 5 --warmup 2 \
    --no-quadratic --json "$out/prefill.json" 2>&1 | tee -a "$out/prefill.txt"
bench_rc=${PIPESTATUS[0]}

echo "== 4. B=1, N=32k, deployed prefix M=1024" | tee "$out/prefill_b1.txt"
timeout 20 "$python" benchmarks/prefill.py --batch 1 --seq-lens 32768 --prefix 1024 --no-quadratic --repeats 10 \
    --json "$out/prefill_b1.json" 2>&1 | tee -a "$out/prefill_b1.txt"
b1_rc=${PIPESTATUS[0]}

echo "== 5. whole-model prefill, JRT-RNN vs Llama, bf16, batch 1 and 8" | tee "$out/model_prefill.txt"
model_prefill_rc=0
for batch in 1 8; do
    timeout 20 "$python" benchmarks/model_prefill.py --dtype bfloat16 --batch $batch --lengths 2048 8192 32768 \
        --json "$out/model_prefill_b$batch.json" 2>&1 | tee -a "$out/model_prefill.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || model_prefill_rc=1
done

echo "== 6. decode per token through generate(): default (eager) and static (compiled), bf16, batch 16" \
    | tee "$out/decode.txt"
timeout 45 "$python" benchmarks/decode.py --device cuda --dtype bfloat16 --batch 16 --lengths 2048 8192 32768 \
    --steps 32 --generate 2>&1 | tee -a "$out/decode.txt"
decode_rc=${PIPESTATUS[0]}
echo "-- the released 360M shape (hidden 1024, 26 layers, 16 heads)" | tee -a "$out/decode.txt"
timeout 45 "$python" benchmarks/decode.py --device cuda --dtype bfloat16 --batch 16 --lengths 2048 8192 --steps 32 \
    --hidden-size 1024 --layers 26 --heads 16 --vocab-size 50264 --generate 2>&1 | tee -a "$out/decode.txt"
[ "$decode_rc" -eq 0 ] && decode_rc=${PIPESTATUS[0]}

echo "== 7. kernel launches: an eager decode step (batch 16) and a 4k prefill (batch 1, 8)" | tee "$out/launches.txt"
timeout 20 "$python" benchmarks/launches.py --device cuda --dtype bfloat16 --json "$out/launches.json" 2>&1 \
    | tee -a "$out/launches.txt"
launches_rc=${PIPESTATUS[0]}

echo "== 8. a training step's tokens/s, JRT-RNN vs Llama, bf16, batch 4" | tee "$out/train.txt"
timeout 30 "$python" benchmarks/train_step.py --device cuda --dtype bfloat16 --lengths 2048 8192 2>&1 \
    | tee -a "$out/train.txt"
train_rc=${PIPESTATUS[0]}

echo "== 9. vLLM decode throughput, JRT-RNN vs Llama, both compiled as vLLM runs them (needs vllm: a wheel in .whl/)" | tee "$out/serve.txt"
serve_rc=0
if "$python" -c "import vllm" > /dev/null 2>&1; then
    timeout 65 "$python" benchmarks/serve.py --prompt-len 2048 --new-tokens 128 --requests 64 --dtype bfloat16 \
        --compiled --rounds 1 --json "$out/serve.json" 2>&1 | tee -a "$out/serve.txt"
    serve_rc=${PIPESTATUS[0]}
else
    echo "vllm does not import here: step skipped" | tee -a "$out/serve.txt"
fi

# 10. (optional, JRT_GPU_CHECK_PTXAS=1, about 2 more minutes) triton runs ptxas with --regAllocOptLevel=2, a workaround
#    for a ptxas 13.x bug it does not name; without it the sm_90 dq scan builds spill-free (docs/performance.md,
#    "Backward pass 9"). Triton's PTXAS_OPTIONS comes after that flag, and ptxas takes the last value: level 4 built
#    like ptxas's own default for every kernel here. The compiled backward tests and the paper-shape benchmark at
#    32k, with it.
ptxas_rc=0
if [ "${JRT_GPU_CHECK_PTXAS:-0}" = "1" ]; then
    echo "== 10. backward tests and 32k benchmark with PTXAS_OPTIONS=--regAllocOptLevel=4" | tee "$out/ptxas.txt"
    PTXAS_OPTIONS=--regAllocOptLevel=4 JRT_TRITON_AUTOTUNE=0 timeout 120 "$python" -m pytest -q -p no:cacheprovider \
        -o addopts="" tests/jrt_kernels/test_prefix_linear_attention_backward.py 2>&1 | tee -a "$out/ptxas.txt"
    ptxas_rc=${PIPESTATUS[0]}
    PTXAS_OPTIONS=--regAllocOptLevel=4 timeout 90 "$python" benchmarks/prefill.py --seq-lens 32768 --train-step \
        --repeats 10 --warmup 3 --json "$out/ptxas.json" 2>&1 | tee -a "$out/ptxas.txt"
    ptxas_bench_rc=${PIPESTATUS[0]}
    [ "$ptxas_rc" -eq 0 ] && ptxas_rc=$ptxas_bench_rc
fi

echo "kernel tests rc=$tests_rc, model checks rc=$model_rc, prefill benchmark rc=$bench_rc, B=1 benchmark rc=$b1_rc," \
    "model prefill rc=$model_prefill_rc, decode rc=$decode_rc, launches rc=$launches_rc, training rc=$train_rc," \
    "vLLM rc=$serve_rc, ptxas step rc=$ptxas_rc" \
    | tee "$out/summary.txt"
rm -rf "$site"
exit $((tests_rc != 0 || model_rc != 0 || bench_rc != 0 || b1_rc != 0 || model_prefill_rc != 0 || decode_rc != 0 \
    || launches_rc != 0 || train_rc != 0 || serve_rc != 0 || ptxas_rc != 0))
