"""Start-up calibration of adaptive k (adaptive.py): step seconds by (k, batch size), timed on the engine's own
decode steps at batch sizes 1, 4, 16, 64 (as many as fit); the k take turns, each held for three steps, the third
timed (the first verifies the k before), after a turn that warms up:   k: 0 0 0* 1 1 1* 2 2 2* 0 0 0* ..."""
import logging
import statistics
import time

import torch

from mtpserve.sampling_params import SamplingParams
from mtpserve.spec_decode.adaptive import AdaptiveK

logger = logging.getLogger("mtpserve")

TIMED_PER_K, HOLD = 4, 3


def calibrate(engine, policy: AdaptiveK, prompt_len: int = 16, max_tokens: int = 96) -> None:
    started, gen, block_size = time.monotonic(), torch.Generator().manual_seed(0), engine.config.block_size
    room = min(engine.max_model_len, engine.block_manager.num_blocks * block_size) - engine.max_step_overshoot
    prompt_len = max(1, min(prompt_len, room // 4))
    params = SamplingParams(temperature=0.0, max_tokens=max(1, min(max_tokens, room - prompt_len)), ignore_eos=True)
    per_request = -(-(prompt_len + params.max_tokens + engine.max_step_overshoot) // block_size)
    most = max(1, min(engine.max_num_seqs, engine.block_manager.num_blocks // per_request,   # (no preemption)
                      engine.config.max_num_batched_tokens // (1 + policy.max_k)))         # (one step at every k)
    learned = dict(reached=policy.reached[:], accepted=policy.accepted[:], choices=policy.choices[:])   # (kept)
    turn = [k for k in range(policy.max_k + 1) for _ in range(HOLD)]
    times = {k: {} for k in turn}

    def fewest(batch):   # steps timed at this batch size, for the k timed least
        return min(len(by_batch.get(batch, ())) for by_batch in times.values())

    for batch in sorted({1, min(4, most), min(16, most), min(64, most)}):
        step = 0
        for attempt in range(4):   # (a fresh set of requests when the last ends before every k is timed)
            ids = [f"adaptive-calibration-{batch}-{attempt}-{i}" for i in range(batch)]
            for rid in ids:
                prompt = torch.randint(engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist()
                engine.add_request(rid, None, prompt, params)
            while engine.has_unfinished_requests() and fewest(batch) < TIMED_PER_K:
                policy.forced, policy.last_step = turn[step % len(turn)], None
                engine.step()
                if step >= len(turn) and step % HOLD == HOLD - 1 and (policy.last_step or [0])[0] == batch:
                    times[policy.forced].setdefault(batch, []).append(policy.last_step[2])
                step += 1
            for rid in ids:
                engine.abort_request(rid)
            if fewest(batch) >= TIMED_PER_K:
                break
    table = {k: {b: statistics.median(t) for b, t in by_batch.items()} for k, by_batch in times.items()}
    vars(policy).update(vars(AdaptiveK(policy.max_k, table=table if all(table.values()) else {}, **learned)))
    logger.info("adaptive speculation: step costs calibrated in %.1fs (ms by k, then batch size): %s", time.monotonic()
                - started, {k: {b: round(s * 1e3, 2) for b, s in sorted(t.items())} for k, t in policy.table.items()})
