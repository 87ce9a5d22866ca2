"""Start-up calibration of adaptive speculation length (spec_decode/adaptive.py): real decode steps of every k,
timed by the engine's own step loop, so that the policy can price each k from its first step."""
import logging
import time

from mtpserve.spec_decode.adaptive import AdaptiveK

logger = logging.getLogger("mtpserve")


def calibrate(engine, policy: AdaptiveK, prompt_len: int = 16, max_tokens: int = 96) -> None:
    """Start-up: real decode steps for every k at batch sizes 1, 4, 16 and max_num_seqs (up to 64, and at most as
    many as the KV cache holds at once), timed by the engine's own step loop (observe), on random prompts. The
    k take turns step by step (each held for three steps, the third the one timed: it verifies and drafts that
    k after a step that did too; adaptive.observe), so that every k's steps are timed within moments of the
    others': their ratios are what the policy prices by, and this machine's speed drifts. Requests long enough
    for about five timed steps of each k at every size (a step's time varies by 10-20% here: three steps per k
    left cost ratios a fifth off at batch 64), on short prompts (a short max_model_len leaves room for more
    steps). Twice: the first round only
    warms up (the first steps of a fresh engine run slow). Their acceptance, the engine's spec-decode counters
    and preemption counts are forgotten afterwards."""
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
    most = max(1, min(engine.max_num_seqs, engine.block_manager.num_blocks // per_request))   # (no preemption)
    sizes = sorted({1, min(4, most), min(16, most), min(64, most)})
    turns = [k for k in range(policy.max_k + 1) for _ in range(3)]
    for timed in (False, True):
        policy.timed.clear()   # (after the warm-up round: its times)
        for batch in sizes:
            ids = [f"adaptive-calibration-{timed:d}-{batch}-{i}" for i in range(batch)]
            try:
                for rid in ids:
                    prompt = torch.randint(engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist()
                    engine.add_request(rid, None, prompt, params)
                step = 0
                while engine.has_unfinished_requests():
                    policy.forced = turns[step % len(turns)]
                    engine.step()
                    step += 1
            finally:
                for rid in ids:
                    engine.abort_request(rid)
    policy.forced, policy.current, policy.choices = None, None, [0] * (policy.max_k + 1)
    policy.relate_costs()
    policy.forget_acceptance()
    engine.spec_metrics = SpecDecodeMetrics(policy.max_k)
    for core in engine.cores:
        core.num_preemptions = 0
    logger.info("adaptive speculation: step costs calibrated in %.1fs (ms by k, then batch size): %s",
                time.monotonic() - started, {k: {b: round(s * 1e3, 2) for b, s in sorted(t.items())}
                                             for k, t in sorted(policy.step_seconds.items())})
