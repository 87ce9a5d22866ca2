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
for spec in none mtp_k2 adaptive_k3; do
  extra=()
  [ $spec = mtp_k2 ] && extra=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}')
  [ $spec = adaptive_k3 ] && extra=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 3, "adaptive": true}')
  mtpserve serve --port 18124 --max-num-seqs 32 --enforce-eager "${extra[@]}" > /tmp/bench_adaptive_server.log 2>&1 &
  server=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:18124/health > /dev/null && break; sleep 0.5; done
  for c in 1 4 16 32; do
    $B serve --port 18124 --num-prompts $((c * 4 > 16 ? c * 4 : 16)) --input-len 32 --output-len 64 \
      --max-concurrency $c --output-json $R/serve_adaptive_${spec}_c$c.json
  done
  kill $server; wait $server || true
done
python - <<'PY'
import json
rows = []
for c in (1, 4, 16, 32):
    cells = []
    for spec in ("none", "mtp_k2", "adaptive_k3"):
        r = json.load(open(f"docs/bench_results/serve_adaptive_{spec}_c{c}.json"))["results"]
        cells.append((r["tpot_ms"]["median"], r["output_token_throughput"]))
    rows.append(f"| {c} | " + " | ".join(f"{t:.1f} ms / {s:.1f}" for t, s in cells) +
                f" | {cells[0][0] / cells[2][0]:.2f}x | {cells[1][0] / cells[2][0]:.2f}x |")
print("| concurrency | no MTP: TPOT median / tok/s | MTP k=2 | adaptive (max 3) | adaptive TPOT gain vs no MTP | vs k=2 |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
PY
