"""Start-up calibration of adaptive speculation length (spec_decode/adaptive.py): real decode steps of every k,
timed by the engine's own step loop, so that the policy can price each k from its first step."""
import logging
import time

from mtpserve.spec_decode.adaptive import AdaptiveK

logger = logging.getLogger("mtpserve")


TIMED_PER_K = 4      # steady steps timed per k at each batch size (a step's time varies by 10-20% here)
MAX_REQUEST_SETS = 4
WARMUP_TURNS = 1     # turns through every k per batch size before timing (a fresh engine's first steps run slow)


def calibrate(engine, policy: AdaptiveK, prompt_len: int = 16, max_tokens: int = 96) -> None:
    """Start-up: real decode steps for every k at batch sizes 1, 4, 16 and max_num_seqs (up to 64, at most as many
    as the KV cache holds at once, and as one step's token budget takes at the largest k), timed by the engine's own
    step loop (observe), on random prompts. The k take turns step by step (each held for three steps, the third the
    one timed: it verifies and drafts that k after a step that did too; adaptive.observe), so that every k's steps
    are timed within moments of the others': their ratios are what the policy prices by, and this machine's speed
    drifts. At each size, one untimed turn through every k warms up, then the turns go on until every k has
    TIMED_PER_K steps timed (three steps per k left cost ratios a fifth off at batch 64), on requests of max_tokens
    each on short prompts (a fresh set when they end first; at most MAX_REQUEST_SETS). Their acceptance, the
    engine's spec-decode counters and preemption counts are forgotten afterwards."""
    import torch

    from mtpserve.sampling_params import SamplingParams
    from mtpserve.spec_decode.metrics import SpecDecodeMetrics
    started = time.monotonic()
    gen = torch.Generator().manual_seed(0)
    capacity = engine.block_manager.num_blocks * engine.config.block_size   # (a small KV cache, or a short
    room = min(engine.max_model_len, capacity) - engine.max_step_overshoot    # max_model_len: shorter requests)
    prompt_len = max(1, min(prompt_len, room // 4))
    max_tokens = max(1, min(max_tokens, room - prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    per_request = -(-(prompt_len + max_tokens + engine.max_step_overshoot) // engine.config.block_size)
    most = max(1, min(engine.max_num_seqs, engine.block_manager.num_blocks // per_request,   # (no preemption)
                      engine.config.max_num_batched_tokens // (1 + policy.max_k)))   # (one step at every k)
    sizes = sorted({1, min(4, most), min(16, most), min(64, most)})
    turns = [k for k in range(policy.max_k + 1) for _ in range(3)]
    policy.timed.clear()
    for batch in sizes:
        step = 0
        for attempt in range(MAX_REQUEST_SETS):   # (a fresh set when the last ends before the k are timed)
            ids = [f"adaptive-calibration-{batch}-{attempt}-{i}" for i in range(batch)]
            try:
                for rid in ids:
                    prompt = torch.randint(engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist()
                    engine.add_request(rid, None, prompt, params)
                while engine.has_unfinished_requests() and not timed_enough(policy, batch):
                    if step == WARMUP_TURNS * len(turns):   # (whole turns: the k go on in order)
                        forget_times(policy, batch)
                    policy.forced = turns[step % len(turns)]
                    engine.step()
                    step += 1
            finally:
                for rid in ids:
                    engine.abort_request(rid)
            if timed_enough(policy, batch):
                break
    policy.forced, policy.current, policy.choices = None, None, [0] * (policy.max_k + 1)
    policy.relate_costs()
    policy.forget_acceptance()
    engine.spec_metrics = SpecDecodeMetrics(policy.max_k)
    for core in engine.cores:
        core.num_preemptions = 0
    logger.info("adaptive speculation: step costs calibrated in %.1fs (ms by k, then batch size): %s",
                time.monotonic() - started, {k: {b: round(s * 1e3, 2) for b, s in sorted(t.items())}
                                             for k, t in sorted(policy.step_seconds.items())})


def timed_enough(policy: AdaptiveK, batch: int) -> bool:
    return all(len(policy.timed.get(k, {}).get(batch, ())) >= TIMED_PER_K for k in range(policy.max_k + 1))


def forget_times(policy: AdaptiveK, batch: int) -> None:
    """Drops the warm-up's times at this batch size."""
    for by_batch in policy.timed.values():
        by_batch.pop(batch, None)
    policy.last_steady = None
