#!/usr/bin/env bash
# A/B of MINFER_DECODE_OVERLAP (engine/cuda_graph.py: decode graphs from that batch size up run
# the model as two halves on two streams) on the offline bench, alternating settings, with the
# GPU test of the split graphs after the first pair. Run from the repository root on the GPU
# host with the wheels of shared/gpu/README.md (.whl carried). MODEL, EXTRA (bench flags) and
# SETTINGS ("min_batch[:stagger]" words) override the defaults.
#   bash scripts/gpu_overlap_ab.sh
#   MODEL=llama-3.1-8b SETTINGS="0 144 0 144" bash scripts/gpu_overlap_ab.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/scripts
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=${OUT:-/tmp}
i=0
for v in ${SETTINGS:-0 144 test 64 144:1 0 144 64}; do
  if [ "$v" = test ]; then
    SECONDS=0
    timeout 240 python3 -m pytest -x -q -p no:cacheprovider tests/engine/test_decode_overlap_gpu.py 2>&1 | tail -3
    echo "test ${SECONDS}s"
    continue
  fi
  min=${v%%:*}; stagger=0; [ "$v" != "$min" ] && stagger=${v##*:}
  i=$((i+1)); SECONDS=0; f=$OUT/run_${i}_${min}_${stagger}.txt
  echo "== overlap=$min stagger=$stagger"
  MINFER_DECODE_OVERLAP=$min MINFER_DECODE_OVERLAP_STAGGER=$stagger timeout 150 \
    python3 -m minfer bench offline ${MODEL:-qwen3-0.6b} $EXTRA > "$f" 2>&1
  grep -E "^throughput|^prefill|decode ms per step|Error|error" "$f" | head -4 | cut -c1-400
  echo "${SECONDS}s"
done
