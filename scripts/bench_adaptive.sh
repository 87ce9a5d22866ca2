#!/usr/bin/env bash
# Adaptive speculation length against fixed k and no speculation: offline (bench adaptive, eager and graph
# mode) and serving; --serve-only skips the offline part (every configuration's server at once, the clients at
# concurrency 1, 4, 16, 32 interleaved in rounds; ROUNDS=3 by default).
set -euo pipefail
cd "$(dirname "$0")/.."
B="mtpserve bench"
R=${R:-docs/bench_results}
if [ "${1:-}" != "--serve-only" ]; then
$B adaptive --lockstep --max-k 3 --batch-sizes 1,8,32,64 --input-len 32 --output-len 64 --num-iters 2 \
  --output-json $R/adaptive_eager_k3.json
$B adaptive --lockstep --graph-mode --max-k 2 --batch-sizes 1,8 --input-len 32 --output-len 64 --num-iters 2 \
  --output-json $R/adaptive_graph_k2.json
fi
# Serving: every configuration's server up at once (an idle one costs nothing), the clients interleaved in
# rounds (each round runs every configuration at every concurrency), so that a slow minute on this shared
# machine hits all of them; each configuration's TPOT is its median over the rounds.
# (a configuration ending in _overlap runs its server with --overlap, e.g. SPECS="... adaptive_k3_overlap")
SPECS=${SPECS:-"none mtp_k1 mtp_k2 mtp_k3 adaptive_k3"}
ROUNDS=${ROUNDS:-3}
servers=()
trap 'kill "${servers[@]}" 2> /dev/null || true' EXIT
port=18124
for spec in $SPECS; do
  extra=()
  base=${spec%_overlap}
  case $base in
    mtp_k*) extra=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": ${base#mtp_k}, \"adaptive\": false}") ;;
    adaptive_k*) extra=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": ${base#adaptive_k}, \"adaptive\": true}") ;;
  esac
  [ "$base" != "$spec" ] && extra+=(--overlap)
  mtpserve serve --port $port --max-num-seqs 32 --enforce-eager "${extra[@]}" > /tmp/bench_adaptive_server_$spec.log 2>&1 &
  servers+=($!)
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 0.5; done
  port=$((port + 1))
done
for round in $(seq 1 $ROUNDS); do
  for c in 1 4 16 32; do
    port=18124
    for spec in $SPECS; do
      $B serve --port $port --num-prompts $((c * 2 > 12 ? c * 2 : 12)) --input-len 32 --output-len 48 \
        --max-concurrency $c --seed $round --output-json $R/serve_adaptive_${spec}_c${c}_r$round.json
      port=$((port + 1))
    done
  done
done
R="$R" SPECS="$SPECS" ROUNDS="$ROUNDS" python - <<'PY'
import json, os, statistics
specs, rounds = os.environ["SPECS"].split(), int(os.environ["ROUNDS"])
fixed = [s for s in specs if not s.startswith("adaptive") and not s.endswith("_overlap")]
ada = next(s for s in specs if s.startswith("adaptive") and not s.endswith("_overlap"))
print(f"TPOT median ms, median over {rounds} interleaved rounds")
print("| concurrency | " + " | ".join(specs) + " | adaptive vs none | adaptive vs best fixed |")
print("|---" * (len(specs) + 3) + "|")
tpot_at = {}
for c in (1, 4, 16, 32):
    tpot = tpot_at[c] = {s: statistics.median(json.load(open(f"{os.environ['R']}/serve_adaptive_{s}_c{c}_r{r}.json"))
                                 ["results"]["tpot_ms"]["median"] for r in range(1, rounds + 1)) for s in specs}
    best = min(fixed, key=tpot.get)
    print(f"| {c} | " + " | ".join(f"{tpot[s]:.1f}" for s in specs) +
          f" | {tpot['none'] / tpot[ada]:.2f}x | {tpot[best] / tpot[ada]:.2f}x ({best}) |")
for s in specs:
    if s.endswith("_overlap") and s.removesuffix("_overlap") in specs:
        ratios = [tpot_at[c][s.removesuffix("_overlap")] / tpot_at[c][s] for c in (1, 4, 16, 32)]
        print(f"{s}: TPOT without / with overlap at concurrency 1/4/16/32: " + " / ".join(f"{r:.3f}" for r in ratios))
PY
