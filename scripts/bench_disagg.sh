#!/usr/bin/env bash
# Disaggregated serving (docs/BENCHMARKS.md "Serving"): one colocated server with both cores vs one prefill and
# one decode server (one core each) behind `mtpserve proxy`, in both hand-off schemes; long prompts (1024
# tokens) arriving while others decode. Shipped model, MTP k=1. Hand-off counters are saved from /metrics.
set -euxo pipefail
cd "$(dirname "$0")/.."
R=${R:-docs/bench_results}
mkdir -p $R
SPEC='{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}'
BENCH="mtpserve bench serve --num-prompts 24 --input-len 1024 --output-len 64 --max-concurrency 4 --seed 0"
up() { for _ in $(seq 1 240); do curl -s -o /dev/null -w '%{http_code}' "$1/health" | grep -q 200 && return 0; sleep 0.5; done; return 1; }
OMP_NUM_THREADS=2 mtpserve serve --port 18300 --speculative-config "$SPEC" & C=$!
up http://127.0.0.1:18300
$BENCH --base-url http://127.0.0.1:18300 --output-json $R/disagg_colocated_2cores.json
kill $C; wait $C || true
for scheme in drafts hidden; do   # fresh servers per scheme: their /metrics counters are this run's
  OMP_NUM_THREADS=1 mtpserve serve --port 18301 --speculative-config "$SPEC" \
    --kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 18401}' & P=$!
  OMP_NUM_THREADS=1 mtpserve serve --port 18302 --speculative-config "$SPEC" \
    --kv-transfer-config '{"kv_role": "kv_consumer", "kv_port": 18402}' & D=$!
  up http://127.0.0.1:18301; up http://127.0.0.1:18302
  mtpserve proxy --prefill http://127.0.0.1:18301 --decode http://127.0.0.1:18302 --port 18303 \
    --mtp-handoff $scheme & X=$!
  up http://127.0.0.1:18303
  $BENCH --base-url http://127.0.0.1:18303 --output-json $R/disagg_1p1d_$scheme.json
  curl -s http://127.0.0.1:18302/metrics | grep -E '^mtpserve:(kv_handoff|spec_decode_(num|mean)|disagg)' \
    > $R/disagg_1p1d_${scheme}_decode_metrics.txt
  kill $X $P $D; wait $X $P $D || true
done
# The decode side's first step after a scheme-2 hand-off: padded graph vs eager target step (in-process)
for k in 1 2; do
  mtpserve bench handoff --k $k --batch-size 8 --input-len 256 --num-iters 5 --threads 2 \
    --output-json $R/handoff_first_step_k${k}_b8.json
done
