#!/usr/bin/env bash
# The CUDA checks, in one short call on a lent GPU (run from the repository root; a few minutes):
#   greedy tokens on CUDA (eager, and graph mode = CUDA graphs) equal the CPU's, with MTP (fixed and adaptive k)
#   and without; the prefix cache on and off; batch-1 and batch-8 decode speed, each configuration side by side.
# Results: $OUT/gpu_check.json when $OUT is set (the device tool), else ./gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || pip install -q torch
pip install -q -e . >/dev/null
python3 - "${OUT:-.}/gpu_check.json" <<'EOF'
import json, sys, time
import torch
from mtpserve import LLM, SamplingParams

prompts = ["def fibonacci(n):", "import os\n\n\ndef list_files(root):", "class Stack:\n    def __init__(self):"] * 3
greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
mtp = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
configs = {"no_spec": None, "mtp_k2": mtp, "mtp_adaptive_k2": {"method": "mtp", "num_speculative_tokens": 2}}
cpu = {name: [o.outputs[0].token_ids for o in LLM(None, speculative_config=spec, device="cpu").generate(
    prompts, greedy, use_tqdm=False)] for name, spec in configs.items()}
report = {"device": torch.cuda.get_device_name(0), "runs": []}
for name, spec in configs.items():
    for eager in (True, False):
        for caching in (True, False):
            started = time.perf_counter()
            llm = LLM(None, speculative_config=spec, device="cuda", enforce_eager=eager,
                      enable_prefix_caching=caching, graph_batch_sizes=[1, 8])
            start_s = time.perf_counter() - started
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            speed = {}
            for batch in (1, 8):
                t = time.perf_counter()
                llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True),
                             use_tqdm=False)
                speed[f"tok_per_s_b{batch}"] = batch * 128 / (time.perf_counter() - t)
            run = dict(config=name, eager=eager, prefix_caching=caching, start_s=start_s,
                       same_as_cpu=[o.outputs[0].token_ids for o in outs] == cpu[name],
                       metrics={k: v for k, v in llm.get_metrics().items() if not isinstance(v, list)}, **speed)
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
            llm.engine.shutdown()
json.dump(report, open(sys.argv[1], "w"), indent=1)
print("all equal to the CPU:", all(r["same_as_cpu"] for r in report["runs"]))
EOF
