#!/usr/bin/env bash
# Every GPU check of stepnet's cuda backend in one short run (a few minutes),
# for a machine with an NVIDIA GPU and a Python that holds numba-cuda and
# PyTorch with CUDA:
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# 1. the machine: GPU, driver, versions;
# 2. every CUDA test of the suite (`-k cuda`), on the GPU;
# 3. benchmarks/cuda_profile.py: W1, W3, W5 under each time-loop driver;
# 4. benchmarks/run.py --cuda: W1, W3, W5 against cuDNN (fp32 math and TF32
#    allowed) and PyTorch's eager loop and torch.compile of the W5 cell, one
#    table, each peer in its own process.
#
# numba-cuda 0.30 names np.row_stack, which NumPy 2.5 removed: where the
# Python's NumPy lacks it and wheels lie in .whl/ (a NumPy 2.4 one), they are
# installed to /tmp/site first. PYTHON picks the interpreter (default python3);
# SECTION_TIMEOUT the seconds each section may take (default 240); with
# MARKDOWN=docs/benchmarks.md the table becomes that page's section for the GPU.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT=${SECTION_TIMEOUT:-240}
export PYTHONUNBUFFERED=1
if ! $PY -c "import numpy; numpy.row_stack" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export STEPNET_CACHE_DIR=${STEPNET_CACHE_DIR:-/tmp/stepnet_gpu_cache}

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
$PY - <<'EOF'
import numba, numpy, platform
from numba import cuda
print("python", platform.python_version(), "numpy", numpy.__version__, "numba", numba.__version__)
try:
    import importlib.metadata as md
    print("numba-cuda", md.version("numba-cuda"))
except Exception as exc:  # noqa: BLE001 - a report, not a check
    print("numba-cuda version unknown:", exc)
d = cuda.get_current_device()
print("device", d.name, "cc", d.compute_capability, "SMs", d.MULTIPROCESSOR_COUNT,
      "shared a block (opt-in)", getattr(d, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "?"))
from stepnet.jit import cuda_run
print("loop kernels may have", cuda_run._shared_limit(), "bytes of shared memory a block")
try:
    import torch
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
except Exception as exc:  # noqa: BLE001
    print("torch unavailable:", exc)
EOF

echo "== CUDA tests"
timeout "$LIMIT" $PY -m pytest -q -n 8 -k cuda -p no:cacheprovider tests/ 2>&1 | tail -25

echo "== time-loop drivers (ms a call)"
timeout "$LIMIT" $PY benchmarks/cuda_profile.py 2>&1 | tail -30

echo "== benchmark"
timeout "$LIMIT" $PY benchmarks/run.py --cuda --peers stepnet-cuda,torch-cuda \
    --workloads W1,W3,W5 --no-compile --rounds 5 --timeout "$LIMIT" \
    ${MARKDOWN:+--markdown "$MARKDOWN"} 2>&1 | tail -40
