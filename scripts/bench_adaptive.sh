#!/usr/bin/env bash
# Adaptive speculation length against fixed k and no speculation: offline (bench adaptive, eager and graph
# mode) and serving; --serve-only skips the offline part (one server per configuration, the same clients at concurrency 1, 4, 16, 32).
set -euo pipefail
cd "$(dirname "$0")/.."
B="mtpserve bench"
R=docs/bench_results
if [ "${1:-}" != "--serve-only" ]; then
$B adaptive --max-k 3 --batch-sizes 1,8,32,64 --input-len 32 --output-len 64 --num-iters 2 \
  --output-json $R/adaptive_eager_k3.json
$B adaptive --graph-mode --max-k 2 --batch-sizes 1,8 --input-len 32 --output-len 64 --num-iters 2 \
  --output-json $R/adaptive_graph_k2.json
fi
SPECS="none mtp_k1 mtp_k2 mtp_k3 adaptive_k3"
for spec in $SPECS; do
  extra=()
  case $spec in
    mtp_k*) extra=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": ${spec#mtp_k}}") ;;
    adaptive_k*) extra=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": ${spec#adaptive_k}, \"adaptive\": true}") ;;
  esac
  mtpserve serve --port 18124 --max-num-seqs 32 --enforce-eager "${extra[@]}" > /tmp/bench_adaptive_server.log 2>&1 &
  server=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:18124/health > /dev/null && break; sleep 0.5; done
  for c in 1 4 16 32; do
    $B serve --port 18124 --num-prompts $((c * 2 > 12 ? c * 2 : 12)) --input-len 32 --output-len 48 \
      --max-concurrency $c --output-json $R/serve_adaptive_${spec}_c$c.json
  done
  kill $server; wait $server || true
done
SPECS="$SPECS" python - <<'PY'
import json, os
specs = os.environ["SPECS"].split()
fixed = [s for s in specs if not s.startswith("adaptive")]
ada = next(s for s in specs if s.startswith("adaptive"))
print("| concurrency | " + " | ".join(f"{s}: TPOT median ms" for s in specs) + " | adaptive vs none | adaptive vs best fixed |")
print("|---" * (len(specs) + 3) + "|")
for c in (1, 4, 16, 32):
    tpot = {s: json.load(open(f"docs/bench_results/serve_adaptive_{s}_c{c}.json"))["results"]["tpot_ms"]["median"]
            for s in specs}
    best = min(fixed, key=tpot.get)
    print(f"| {c} | " + " | ".join(f"{tpot[s]:.1f}" for s in specs) +
          f" | {tpot['none'] / tpot[ada]:.2f}x | {tpot[best] / tpot[ada]:.2f}x ({best}) |")
PY
