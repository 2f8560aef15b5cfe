#!/usr/bin/env bash
# Whether MINFER_GEMV_PROLOGUE=on (the RMSNorms and the SiLU-and-multiply folded into gemv's
# prologues, docs/PERFORMANCE.md section 19) pays and can become the default: the tests that go
# through it on the GPU, the layer chain of scripts/gpu_gemv.py, then the batch-1 steps and the
# offline workload with and without it. Run after scripts/gpu_pdl_chain_check.sh (one call each:
# together they are over the 600 s a call may take), from the repository root on the GPU host,
# with the wheels of shared/gpu/README.md installed and PYTHONPATH=/tmp/site:$PWD:$PWD/tests.
# CHAIN=1 (the default if the chain check passed) runs every engine figure with MINFER_PDL=chain.
set -uo pipefail
pdl=$([ "${CHAIN:-1}" = 1 ] && echo chain || echo 1)
echo "== tests with MINFER_GEMV_PROLOGUE=on, MINFER_PDL=$pdl =="
MINFER_GEMV_PROLOGUE=on MINFER_PDL=$pdl timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_kernel_gemv.py tests/engine/test_parity.py tests/engine/test_prefill_graphs_gpu.py 2>&1 | tail -3
echo "== layer chains (gemv's own PDL, not the chain) =="
timeout 120 python3 scripts/gpu_gemv.py --rows 1,2 --chains-only 2>&1 | grep "layer chain"
for prologue in off on off on; do
  echo "== MINFER_GEMV_PROLOGUE=$prologue MINFER_PDL=$pdl: batch 1 =="
  MINFER_GEMV_PROLOGUE=$prologue MINFER_PDL=$pdl timeout 60 python3 scripts/gpu_batch1_split.py qwen3-0.6b 2>&1 | tail -1
  MINFER_GEMV_PROLOGUE=$prologue MINFER_PDL=$pdl timeout 90 python3 scripts/gpu_batch1_split.py llama-3.1-8b 2>&1 | tail -1
done
for prologue in off on; do
  echo "== MINFER_GEMV_PROLOGUE=$prologue MINFER_PDL=$pdl: bench offline qwen3-0.6b =="
  MINFER_GEMV_PROLOGUE=$prologue MINFER_PDL=$pdl timeout 150 python3 -m minfer bench offline qwen3-0.6b 2>&1 \
    | grep -E "^throughput|by batch|this run is at" | head -3
done
