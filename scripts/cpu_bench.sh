#!/usr/bin/env bash
# Every figure of issue 17's "Done when", on CPU with the default model:
#   - `minfer bench offline` batch 1 on one thread (decode tok/s);
#   - a server on one thread (core $SERVER_CPU), streaming chat, 256-token prompts, 64 new
#     tokens (ignore_eos), concurrency 1 / 4 / 16 / 64: TTFT p50, ITL p50, output tok/s.
# The client runs on the other core(s) ($CLIENT_CPUS). Run it on a quiet machine.
#   QUANT=gguf scripts/cpu_bench.sh          # QUANT=none for the float32 baseline
#   EXTRA="--max-running-requests 32" scripts/cpu_bench.sh
#   CONCS="16 64" OFFLINE=0 scripts/cpu_bench.sh   # a subset: those concurrencies, no offline run
# Writes JSON and logs under $OUT (default /tmp/cpu_bench) and prints one summary table.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
QUANT=${QUANT:-gguf}
SERVER_CPU=${SERVER_CPU:-1}
CLIENT_CPUS=${CLIENT_CPUS:-0}
PORT=${PORT:-8177}
OUT=${OUT:-/tmp/cpu_bench}
EXTRA=${EXTRA:-}
CONCS=${CONCS:-1 4 16 64}
OFFLINE=${OFFLINE:-1}
mkdir -p "$OUT"
{
  echo "commit $(git rev-parse --short HEAD)  quantization $QUANT  extra: $EXTRA"
  python3 -c "import torch, platform; print(platform.processor() or platform.machine(), torch.__version__, torch.backends.cpu.get_cpu_capability())"
  grep -m1 "model name" /proc/cpuinfo
} | tee "$OUT/machine.txt"

# shellcheck disable=SC2086
[ "$OFFLINE" = 1 ] && taskset -c "$SERVER_CPU" python3 -m minfer bench offline --cpu-threads 1 --quantization "$QUANT" \
  --num-requests 1 --input-len 256 --output-len 256 $EXTRA 2>&1 | grep -v Warning | tail -8 | tee "$OUT/offline.txt"

# shellcheck disable=SC2086
taskset -c "$SERVER_CPU" python3 -m minfer serve --cpu-threads 1 --quantization "$QUANT" --port "$PORT" \
  --log-stats-interval 0 $EXTRA > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 180); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  sleep 1
done
bench() {  # concurrency
  local conc=$1 prompts=$(( $1 * 3 > 16 ? $1 * 3 : 16 ))
  taskset -c "$CLIENT_CPUS" python3 -m minfer bench serve --base-url "http://127.0.0.1:$PORT" --no-progress \
    --endpoint chat --input-len 256 --output-len 64 --ignore-eos --max-concurrency "$conc" \
    --num-prompts "$prompts" --num-warmups 2 --seed "$conc" --output-json "$OUT/conc$conc.json" \
    > "$OUT/conc$conc.txt" 2>&1
}
for conc in $CONCS; do bench "$conc"; done
kill -TERM $SERVER
wait $SERVER

python3 - "$OUT" $CONCS <<'PY'
import json, sys
out = sys.argv[1]
print(f"{'conc':>5} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'output tok/s':>13}")
for conc in map(int, sys.argv[2:]):
    try:
        s = json.load(open(f"{out}/conc{conc}.json"))
        s = s.get("summary", s)
        print(f"{conc:>5} {s['ttft_ms']['p50']:>12.0f} {s['itl_ms']['p50']:>11.1f} {s['output_throughput']:>13.1f}")
    except (OSError, KeyError, ValueError) as e:
        print(f"{conc:>5} no result ({e!r}); see {out}/conc{conc}.txt")
PY
[ "$OFFLINE" = 1 ] && grep "decode throughput" "$OUT/offline.txt"
