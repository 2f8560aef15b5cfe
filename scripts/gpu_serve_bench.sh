#!/usr/bin/env bash
# On the GPU host: the offline bench, then `minfer bench serve` against a dummy-weight server with
# a real tokenizer (MODEL_DIR: a shipped config.json + tokenizer.json + tokenizer_config.json),
# first at rate inf (the nano-vllm draw, next to `bench offline`), then TTFT/ITL at 25/50/80% of the
# request rate measured at inf. Writes JSON and logs under $OUT.
#   scripts/gpu_serve_bench.sh .gpu/qwen3-0.6b
#   SHARES= scripts/gpu_serve_bench.sh .gpu/qwen3-0.6b    # rate inf only (~2 minutes)
set -uo pipefail
MODEL_DIR=${1:?model folder}
OUT=${OUT:-/tmp/out}
SHARES=${SHARES-25 50 80}  # shares of the rate measured at inf
PORT=8123
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"

python3 -m minfer bench offline qwen3-0.6b 2>&1 | grep -v Warning | tail -25 | tee "$OUT/offline.txt"

python3 -m minfer serve "$MODEL_DIR" --load-format dummy --port $PORT --log-stats-interval 0 \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 240); do
  curl -sf http://127.0.0.1:$PORT/health > /dev/null && break
  sleep 1
done
curl -s http://127.0.0.1:$PORT/v1/server_info | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['memory_line'])" | tee -a "$OUT/gpu.txt"

bench() {  # name, then bench serve flags
  local name=$1; shift
  python3 -m minfer bench serve --base-url http://127.0.0.1:$PORT --no-progress --client-processes 4 \
    --output-json "$OUT/$name.json" "$@" 2>&1 | tail -32 | tee "$OUT/$name.txt"
}
bench warm --workload nano-vllm --num-prompts 64 --seed 7
bench inf --workload nano-vllm --request-rate inf
MAX_RATE=$(python3 -c "import json; print(json.load(open('$OUT/inf.json'))['request_throughput'])")
echo "max request rate: $MAX_RATE" | tee -a "$OUT/gpu.txt"
for share in $SHARES; do
  rate=$(python3 -c "print(round($MAX_RATE * $share / 100, 2))")
  bench "rate$share" --workload nano-vllm --request-rate "$rate" --seed $share
done
kill -TERM $SERVER
wait $SERVER
echo "server exit: $?" | tee -a "$OUT/gpu.txt"
