#!/usr/bin/env bash
# Tensor-parallel benchmarks (docs/BENCHMARKS.md "Tensor parallelism"): TP=1 vs TP=2 on the same 2 cores, on the
# ~300M random benchmark model (bf16, then FP8 in memory) and on the shipped model with MTP (acceptance unchanged).
set -euxo pipefail
cd "$(dirname "$0")/.."
R=docs/bench_results
mkdir -p $R runs/bench
M=runs/bench/tp_model_bf16
[ -f $M/config.json ] || python -c "
import torch
from mtpserve.bench.roofline import ROOFLINE_SIZES
from mtpserve.model.checkpoint import write_random_checkpoint
write_random_checkpoint('$M', seed=0, dtype=torch.bfloat16, **ROOFLINE_SIZES)"
B="mtpserve bench parallel --tensor-parallel-sizes 1,2 --threads 2"
$B --model $M --dtype bfloat16 --batch-sizes 1,32 --input-len 32 --output-len 32 --num-iters 2 \
  --output-json $R/parallel_300m_bf16.json
$B --model $M --dtype bfloat16 --quantization fp8 --batch-sizes 1,32 --input-len 32 --output-len 32 --num-iters 2 \
  --output-json $R/parallel_300m_fp8.json
$B --dtype float32 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' --batch-sizes 1,8 \
  --input-len 32 --output-len 64 --num-iters 2 --output-json $R/parallel_default_mtp_k1.json
