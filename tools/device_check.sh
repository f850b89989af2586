#!/usr/bin/env bash
# The checks that need a GPU or TPU, in one run of under 8 minutes, from the repository's root:
#   1. installs the accelerator's jax (CUDA 12 when nvidia-smi answers, else TPU);
#   2. runs the portable path's tests and tests/decoding/test_mesh.py on the real devices;
#   3. benchmarks greedy decoding of the 106M Llama at batch 1 and 64, each figure printed beside
#      the bound of the device's memory bandwidth (python -m benchmarks.bench_mesh --speed).
# Usage: bash tools/device_check.sh   (JAXDECODE_NO_INSTALL=1 skips step 1)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
start=$(date +%s)

if [[ -z "${JAXDECODE_NO_INSTALL:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q -U "jax[cuda12]"
  else
    $PY -m pip install -q -U "jax[tpu]"
  fi
  $PY -m pip install -q -e . pytest pytest-xdist
fi
$PY -c "import jax; print('devices:', jax.devices())"

# the portable path on the accelerator (the native CPU layer stays on the host: not selected)
export JAXDECODE_KERNELS=portable
timeout 240 $PY -m pytest -q -p no:cacheprovider -n 0 -x \
  tests/models/test_hf_families.py tests/decoding/test_sampling.py tests/decoding/test_score.py -m "not slow" || echo "portable tests: FAILED"
# the mesh tests run their cases on 8 forced host devices in processes of their own (with the
# accelerator's jax installed: the same library, another build); the model axis on the real
# devices is exercised by the benchmark below when the machine has more than one
timeout 180 $PY -m pytest -q -p no:cacheprovider -n 0 tests/decoding/test_mesh.py || echo "mesh tests: FAILED"

timeout 120 $PY -m benchmarks.bench_mesh --speed
echo "device check: $(( $(date +%s) - start )) s"
