#!/usr/bin/env bash
# The CUDA checks, in one short call on a lent GPU (run from the repository root; under 8 minutes):
#   tests/test_cuda.py (CUDA graphs = eager = the CPU; MTP lossless with CUDA graphs, fixed and adaptive k; FP8
#   weights; int8 refused on CUDA; TP=2 over NCCL where two GPUs exist), then a short benchmark (batch 1 and 32,
#   MTP off and on, CUDA graphs) printed as one table and written to $OUT/gpu_check.json (else ./gpu_check.json).
# Without a CUDA device it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "no CUDA device: nothing to check here (scripts/gpu_check.sh runs on a GPU machine)"
  exit 0
fi
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || pip install -q torch
pip install -q -e ".[test]" > /dev/null
timeout 420 python3 -m pytest -q -x tests/test_cuda.py
timeout 180 python3 - "${OUT:-.}/gpu_check.json" <<'PY'
import json, sys, time
import torch
from mtpserve import LLM, SamplingParams

prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(root):", "class Stack:\n    def __init__(self):"] * 11
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
rows = []
for name, spec in {"no MTP": None, "MTP k=2": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}}.items():
    llm = LLM(None, speculative_config=spec, device="cuda", graph_batch_sizes=[1, 32])
    for batch in (1, 32):
        llm.generate(prompts[:batch], SamplingParams(max_tokens=8), use_tqdm=False)   # warm-up
        t = time.perf_counter()
        llm.generate(prompts[:batch], params, use_tqdm=False)
        rows.append(dict(config=name, batch=batch, tokens_per_s=batch * 128 / (time.perf_counter() - t)))
    llm.engine.shutdown()
print(f"{torch.cuda.get_device_name(0)}, bf16, CUDA graphs, 128 output tokens")
print("| config | batch | tokens/s |\n|---|---|---|")
for r in rows:
    print(f"| {r['config']} | {r['batch']} | {r['tokens_per_s']:.0f} |")
json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, open(sys.argv[1], "w"), indent=1)
PY
