#!/usr/bin/env bash
# Regenerates docs/BENCHMARKS.md: every benchmark on the shipped default model (one thread each, so that the
# ratios are not distorted by two runs fighting over cores), results kept in docs/bench_results/. The parallel
# and disaggregation results it reports come from scripts/bench_parallel.sh and scripts/bench_disagg.sh.
set -euxo pipefail
cd "$(dirname "$0")/.."
R=docs/bench_results
mkdir -p $R
B="mtpserve bench"
# Batch 1, eager and graph mode side by side (the seed's graph table), in fp32 and in bf16 (the checkpoint's dtype),
# each MTP config with the whole vocabulary and with a 2048-token draft vocabulary
for dt in float32 bfloat16; do
  $B latency --batch-sizes 1 --ks 0,1,2,3,4 --modes eager,graph --draft-vocab-sizes 0,2048 --dtype $dt \
    --input-len 32 --output-len 64 --num-iters 6 --threads 1 --output-json $R/latency_b1_$dt.json
done
# The same verify path with n-gram (prompt lookup) drafts: no MTP layer, no draft head
$B latency --batch-sizes 1 --ks 0,1,2,3 --modes eager,graph --speculative-config '{"method": "ngram"}' \
  --input-len 32 --output-len 64 --num-iters 6 --threads 1 --output-json $R/latency_b1_ngram.json
$B latency --batch-sizes 1,8,32 --ks 0,1,2,3,4 --scorers mqa,batch_expansion --input-len 32 --output-len 64 \
  --num-iters 3 --threads 1 --enforce-eager --output-json $R/latency.json
$B peers --k 2 --batch-size 64 --num-prompts 4 --input-len 32 --output-len 64 --threads 1 --enforce-eager \
  --output-json $R/peers.json
$B peers --k 2 --batch-size 64 --num-prompts 4 --input-len 32 --output-len 64 --threads 1 --graph-mode \
  --output-json $R/peers_graph.json
$B peers --k 2 --batch-size 64 --num-prompts 4 --input-len 32 --output-len 64 --threads 1 --graph-mode \
  --dtype bfloat16 --output-json $R/peers_graph_bf16.json
$B throughput --num-prompts 128 --max-num-seqs 64 --input-len 32 --output-len 64 --threads 1 --enforce-eager \
  --output-json $R/throughput_no_mtp.json
$B throughput --num-prompts 128 --max-num-seqs 64 --input-len 32 --output-len 64 --threads 1 --enforce-eager \
  --speculative-config '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}' --output-json $R/throughput_mtp_k2.json
$B roofline --num-iters 2 --threads 1 --output-json $R/roofline.json
# Measurement mode on the roofline's ~300M random model in bf16 (bandwidth-bound decode, and bf16 GEMMs cost
# the same for 1 and 1+k rows on this CPU): drafts pass at a fixed 0.8, DeepSeek-like acceptance.
$B latency --model runs/bench/roofline_model --ks 0,1,2,3 --batch-sizes 1,8 --synthetic-acceptance 0.8 \
  --input-len 32 --output-len 32 --num-iters 2 --threads 1 --enforce-eager --dtype bfloat16 \
  --output-json $R/latency_synthetic_300m.json
for spec in none mtp_k2; do
  extra=(); [ $spec = mtp_k2 ] && extra=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}')
  OMP_NUM_THREADS=1 mtpserve serve --port 18123 --max-num-seqs 32 --enforce-eager "${extra[@]}" > /tmp/bench_server.log 2>&1 &
  server=$!
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:18123/health > /dev/null && break; sleep 0.5; done
  for c in 1 4 16; do
    $B serve --port 18123 --num-prompts $((c * 4 > 16 ? c * 4 : 16)) --input-len 32 --output-len 64 \
      --max-concurrency $c --output-json $R/serve_${spec}_c$c.json
  done
  kill $server; wait $server || true
done
$B report --results $R/latency_b1_float32.json $R/latency_b1_bfloat16.json $R/latency_b1_ngram.json $R/latency.json $R/peers.json \
  $R/peers_graph.json $R/peers_graph_bf16.json $R/throughput_no_mtp.json \
  $R/throughput_mtp_k2.json $R/serve_none_c{1,4,16}.json $R/serve_mtp_k2_c{1,4,16}.json $R/roofline.json $R/latency_synthetic_300m.json \
  $R/parallel_300m_bf16.json $R/parallel_300m_fp8.json $R/parallel_default_mtp_k1.json \
  $R/parallel_300m_moe_bf16.json $R/parallel_default_dp_ep_mtp_k1.json \
  $R/disagg_colocated_2cores.json $R/disagg_1p1d_drafts.json $R/disagg_1p1d_hidden.json \
  $R/handoff_first_step_k1_b8.json $R/handoff_first_step_k2_b8.json \
  --out docs/BENCHMARKS.md --plot-dir docs --notes mtpserve/bench/notes.md
