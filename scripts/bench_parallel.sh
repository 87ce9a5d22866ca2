#!/usr/bin/env bash
# Parallel-layout benchmarks (docs/BENCHMARKS.md "Tensor parallelism", "Data-parallel attention with expert
# parallelism"): one process vs 2 ranks on the same 2 cores. Dense ~300M random model (TP, bf16 then FP8), a
# ~300M MoE random model (TP=2 vs DP=2+EP), and the shipped model with MTP (acceptance unchanged).
set -euxo pipefail
cd "$(dirname "$0")/.."
R=${R:-docs/bench_results}
mkdir -p $R runs/bench
if [ "${1:-}" = "--default-model-only" ]; then   # (bench_all.sh: the shipped model's layouts)
  mtpserve bench parallel --threads 2 --layouts tp1,tp2,dp2ep --dtype float32 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}' \
    --batch-sizes 1,8 --input-len 32 --output-len 64 --num-iters 2 --output-json $R/parallel_default_mtp_k1.json
  exit 0
fi
M=runs/bench/tp_model_bf16
E=runs/bench/ep_model_bf16
[ -f $M/config.json ] || python -c "
import torch
from mtpserve.bench.roofline import ROOFLINE_SIZES
from mtpserve.model.checkpoint import write_random_checkpoint
write_random_checkpoint('$M', seed=0, dtype=torch.bfloat16, **ROOFLINE_SIZES)"
[ -f $E/config.json ] || python -c "
import torch
from mtpserve.bench.parallel import MOE_SIZES
from mtpserve.model.checkpoint import write_random_checkpoint
write_random_checkpoint('$E', seed=0, dtype=torch.bfloat16, **MOE_SIZES)"
B="mtpserve bench parallel --threads 2"
if [ "${1:-}" != "--ep-only" ]; then
$B --layouts tp1,tp2 --model $M --dtype bfloat16 --batch-sizes 1,32 --input-len 32 --output-len 32 --num-iters 2 \
  --output-json $R/parallel_300m_bf16.json
$B --layouts tp1,tp2 --model $M --dtype bfloat16 --quantization fp8 --batch-sizes 1,32 --input-len 32 --output-len 32 \
  --num-iters 2 --output-json $R/parallel_300m_fp8.json
$B --layouts tp1,tp2 --dtype float32 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}' \
  --batch-sizes 1,8 --input-len 32 --output-len 64 --num-iters 2 --output-json $R/parallel_default_mtp_k1.json
fi
$B --layouts tp1,tp2,dp2ep --model $E --dtype bfloat16 --batch-sizes 1,32 --input-len 32 --output-len 32 --num-iters 2 \
  --output-json $R/parallel_300m_moe_bf16.json
$B --layouts tp1,tp2,dp2ep --dtype float32 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}' \
  --batch-sizes 1,8 --input-len 32 --output-len 64 --num-iters 2 --output-json $R/parallel_default_dp_ep_mtp_k1.json
