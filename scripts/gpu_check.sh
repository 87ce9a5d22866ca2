#!/usr/bin/env bash
# The CUDA checks, in one short call on a lent GPU (run from the repository root; under 9 minutes):
#   tests/test_cuda.py (CUDA graphs = eager = the CPU; MTP lossless with CUDA graphs, fixed and adaptive k; FP8
#   weights; int8 refused on CUDA; TP=2 over NCCL where two GPUs exist), then a short benchmark (batch 1 and 32,
#   MTP off and on, CUDA graphs) printed as one table, a row as each is measured. Logs and the table's JSON go to
#   $OUT (else ./gpu_check/). Without a CUDA device it says so and exits 0.
# The machine may have no network: mtpserve runs from this tree (PYTHONPATH) on the torch that is there; its
# server-side packages (fastapi, zmq, xgrammar) are not needed for these checks.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "no CUDA device: nothing to check here (scripts/gpu_check.sh runs on a GPU machine)"
  exit 0
fi
out="${OUT:-gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, mtpserve; assert torch.cuda.is_available()
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" 2>&1 |
  tee "$out/env.log" || exit 1
# the tests in parallel where pytest-xdist is there (compiling is CPU work; the GPU is mostly idle)
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
timeout 300 python3 -m pytest -v -rA --durations=0 $workers -p no:cacheprovider tests/test_cuda.py 2>&1 |
  tee "$out/tests.log"
tests=${PIPESTATUS[0]}
timeout 190 python3 - "$out/gpu_check.json" <<'PY'
import json, sys, time
import torch
from mtpserve import LLM, SamplingParams

prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(root):", "class Stack:\n    def __init__(self):"] * 11
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
print(f"{torch.cuda.get_device_name(0)}, bf16, CUDA graphs, 128 output tokens, shipped model")
print("| config | batch | tokens/s | graphs built in |\n|---|---|---|---|")
rows = []
specs = {"no MTP": None, "MTP k=2": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}}
for name, spec in specs.items():
    start = time.perf_counter()
    llm = LLM(None, speculative_config=spec, device="cuda", graph_batch_sizes=[1, 32], max_model_len=256)
    built = time.perf_counter() - start
    for batch in (1, 32):
        llm.generate(prompts[:batch], SamplingParams(max_tokens=8), use_tqdm=False)   # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts[:batch], params, use_tqdm=False)
        rows.append(dict(config=name, batch=batch, tokens_per_s=batch * 128 / (time.perf_counter() - t),
                         startup_s=built))
        print(f"| {name} | {batch} | {rows[-1]['tokens_per_s']:.0f} | {built:.0f} s |")
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows},
                  open(sys.argv[1], "w"), indent=1)
    llm.engine.shutdown()
PY
bench=$?
echo "tests: exit $tests; benchmark: exit $bench"
exit $(( tests || bench ))
