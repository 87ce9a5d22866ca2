#!/usr/bin/env bash
# Regenerates docs/BENCHMARKS.md in one sitting: every benchmark on the shipped default model, results in
# docs/bench_results/report/ (emptied first), then `mtpserve bench report` writes the page and its plots from them.
# One thread per engine unless a section says otherwise, so that side-by-side runs do not fight over the 2 cores.
# The llama.cpp peer runs where scripts/build_llamacpp.sh has built it (else its section says it was skipped).
set -euxo pipefail
cd "$(dirname "$0")/.."
export R=docs/bench_results/report
rm -rf $R && mkdir -p $R
start=$(date +%s); started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
B="mtpserve bench"
# MTP speedup by k and batch size, eager and graph mode side by side; adaptive k against fixed k
$B latency --modes eager,graph --batch-sizes 1,8 --ks 0,1,2,3 --input-len 32 --output-len 64 --num-iters 3 \
  --threads 1 --output-json $R/latency.json
$B adaptive --max-k 3 --batch-sizes 1,8,32 --input-len 32 --output-len 64 --num-iters 3 --threads 1 --enforce-eager \
  --output-json $R/adaptive.json
# Batch-1 steps against the bandwidth floor of the bytes they read, graph mode, plain and verifying 1 and 2 drafts
$B roofline --graph-mode --ks 0,1,2 --input-len 32 --output-len 128 --num-iters 3 --threads 1 \
  --output-json $R/roofline.json
# Graph-mode start-up of `mtpserve serve`: graphs compiled at start-up vs in the background, cold and warm cache
$B startup --duration 120 --timeout 900 --output-len 64 --output-json $R/startup.json
# Peers on the same checkpoint: llama.cpp (f32 / bf16 / Q8_0 against our fp32 / bf16 / int8), transformers
$B peers --peers llamacpp --graph-mode --dtypes float32,bfloat16,int8 --ks 0,2 --batch-sizes 1,8 \
  --prompt-lens 512,2048 --output-len 128 --num-iters 3 --threads 1 --output-json $R/peers_llamacpp_graph_t1.json
$B peers --peers llamacpp --enforce-eager --dtypes float32,int8 --ks 0,1 --batch-sizes 32 \
  --prompt-lens 512 --output-len 128 --num-iters 2 --threads 1 --output-json $R/peers_llamacpp_eager_b32_t1.json
$B peers --peers llamacpp --graph-mode --dtypes float32,bfloat16 --ks 0,1 --batch-sizes 32 \
  --prompt-lens 512 --output-len 128 --num-iters 2 --threads 1 --output-json $R/peers_llamacpp_graph_b32_t1.json
$B peers --peers llamacpp --graph-mode --dtypes float32,bfloat16,int8 --ks 0,2 --batch-sizes 1 \
  --prompt-lens 512,2048 --output-len 128 --num-iters 3 --threads 2 --output-json $R/peers_llamacpp_graph_t2.json
$B peers --peers llamacpp --graph-mode --widen 4 --dtypes float32,bfloat16,int8 --ks 0 --batch-sizes 1,8 \
  --prompt-lens 512 --output-len 64 --num-iters 2 --threads 1 --output-json $R/peers_llamacpp_wide4_t1.json
$B peers --peers transformers --k 2 --batch-size 32 --num-prompts 4 --input-len 32 --output-len 64 --threads 1 \
  --graph-mode --output-json $R/peers_transformers.json
# Weight dtypes (quality and speed), request features with MTP, the prefix cache
$B quantization --k 2 --batch-sizes 1,8 --input-len 32 --output-len 64 --num-iters 3 --threads 1 --enforce-eager \
  --output-json $R/quantization.json
$B sampling --k 2 --batch-sizes 1,16 --input-len 32 --output-len 64 --num-iters 2 --threads 1 --enforce-eager \
  --output-json $R/sampling.json
$B sampling --k 2 --batch-sizes 1,16 --input-len 32 --output-len 64 --num-iters 2 --threads 1 --graph-mode \
  --output-json $R/sampling_graph.json
$B prefix --threads 1 --output-json $R/prefix.json
# Serving by concurrency, without and with MTP
for spec in none mtp_k2; do
  extra=(); [ $spec = mtp_k2 ] && extra=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}')
  OMP_NUM_THREADS=1 mtpserve serve --port 18123 --max-num-seqs 32 --enforce-eager "${extra[@]}" > /tmp/bench_server.log 2>&1 &
  server=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:18123/health > /dev/null && break; sleep 0.5; done
  for c in 1 4 16; do
    $B serve --port 18123 --num-prompts $((c * 4 > 16 ? c * 4 : 16)) --input-len 32 --output-len 64 \
      --max-concurrency $c --output-json $R/serve_${spec}_c$c.json
  done
  kill $server; wait $server || true
done
# Scaling layouts and disaggregation (2 processes on the 2 cores)
scripts/bench_parallel.sh --default-model-only
scripts/bench_disagg.sh
echo "{\"started\": \"$started\", \"finished\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\", \"wall_seconds\": $(( $(date +%s) - start ))}" \
  > $R/run.json
$B report --results $R/*.json --out docs/BENCHMARKS.md --plot-dir docs/plots
