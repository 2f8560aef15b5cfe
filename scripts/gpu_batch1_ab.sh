#!/usr/bin/env bash
# Batch-1 decode steps (scripts/gpu_batch1_split.py: wall and graph replay) of code variants
# under environment settings, on the GPU host. Variants are the trees that
# `python3 scripts/ab_variants.py prepare NAME=REF ...` put under .ab/ (carry .ab); each RUNS
# entry is NAME:SETTINGS with SETTINGS comma-separated (empty for the defaults). Every round
# runs the entries in turn, reversed in even rounds, so drift hits all alike.
#   RUNS="base: new:MINFER_DECODE_MERGE=launch new:" MODELS="qwen3-0.6b" ROUNDS=2 \
#     bash scripts/gpu_batch1_ab.sh
# Run from the repository root with the wheels of shared/gpu/README.md installed in /tmp/site.
set -uo pipefail
RUNS=${RUNS:?"RUNS=\"NAME:SETTINGS ...\" (variants under .ab/)"}
MODELS=${MODELS:-qwen3-0.6b}
ROUNDS=${ROUNDS:-1}
for round in $(seq "$ROUNDS"); do
  order=$RUNS
  [ $((round % 2)) = 0 ] && order=$(echo "$RUNS" | tr ' ' '\n' | tac | tr '\n' ' ')
  for model in $MODELS; do
    for entry in $order; do
      name=${entry%%:*}
      settings=${entry#*:}
      echo "== round $round, $model, $name ${settings//,/ } =="
      env ${settings//,/ } PYTHONPATH="/tmp/site:$PWD/.ab/$name:$PWD/tests" OMP_NUM_THREADS=1 \
        timeout 150 python3 scripts/gpu_batch1_split.py "$model" 2>&1 | tail -1
    done
  done
done
