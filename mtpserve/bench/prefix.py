"""`mtpserve bench prefix`: the prefix cache on vs off, side by side on one machine in one run, MTP on.

Three workloads, each run on both engines in turn, iteration by iteration:
- shared: N requests sharing a system prompt, each with its own question, all arriving at once (the cache is
  emptied before each iteration: a burst on a new system prompt);
- chat: C conversations of T turns, each turn's prompt the whole conversation so far (turn t+1 = turn t's
  prompt + its answer + a new question), the C conversations' turn t run together;
- distinct: N prompts sharing nothing (what the cache costs when it cannot help).
Reported: TTFT median / p99, output tokens/s, prompt tokens hit, MTP acceptance (the same on hits and misses:
the tokens, and the drafts, are those of the engine without the cache).
"""
from mtpserve.bench import common
from mtpserve.bench.latency import run_batch


def build(model: str, spec: dict, caching: bool, max_len: int, max_num_seqs: int, dtype: str):
    from mtpserve.engine.engine import LLMEngine
    return LLMEngine.from_kwargs(model=model, speculative_config=spec, max_num_seqs=max_num_seqs, dtype=dtype,
                                 max_model_len=max_len, enable_prefix_caching=caching, enforce_eager=True)


def _summary(runs: list[dict]) -> dict:
    reqs = [r for run in runs for r in run["per_request"]]
    out_tokens = sum(run["num_output_tokens"] for run in runs)
    drafts = sum(run["spec"]["num_draft_tokens"] for run in runs)
    accepted = sum(run["spec"]["num_accepted_tokens"] for run in runs)
    return dict(ttft_ms=common.summarize([r["ttft"] for r in reqs]),
                output_tokens_per_s=out_tokens / sum(run["duration"] for run in runs),
                acceptance_rate=accepted / drafts if drafts else None,
                hit_tokens=sum(run["hits"] for run in runs), prompt_tokens=sum(run["queries"] for run in runs))


def _run(engine, prompts, output_len, tag) -> dict:
    bm = engine.block_manager
    hits, queries = bm.num_hits, bm.num_queries
    r = run_batch(engine, prompts, output_len, tag=tag)
    r.update(hits=bm.num_hits - hits, queries=bm.num_queries - queries)
    return r


def run_prefix(model: str, num_prompts: int, system_len: int, question_len: int, output_len: int, turns: int,
               conversations: int, num_iters: int, k: int, dtype: str, log=print) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    max_len = max(system_len, turns * (question_len + output_len)) + question_len + output_len + 64
    engines = {name: build(model, spec, caching, max_len, max(num_prompts, conversations), dtype)
               for name, caching in (("cache_on", True), ("cache_off", False))}
    first = engines["cache_on"]
    vocab, tok = first.model_config.vocab_size, first.tokenizer
    texts = common.make_prompts(1 + num_prompts * (num_iters + 1) + conversations * turns * num_iters,
                                question_len, vocab, tok, seed=1)
    system = common.make_prompts(num_iters, system_len, vocab, tok, seed=2)
    distinct = common.make_prompts(num_prompts * num_iters, system_len + question_len, vocab, tok, seed=3)
    runs = {(w, name): [] for w in ("shared", "distinct") for name in engines}
    runs.update({(f"chat_turn{t + 1}", name): [] for t in range(turns) for name in engines})
    same_tokens = True
    for eng in engines.values():
        run_batch(eng, texts[:2], 8, tag="w")
    q = iter(texts[2:])
    for it in range(num_iters):
        questions = [next(q) for _ in range(num_prompts)]
        shared = [system[it] + qq for qq in questions]
        chats = [[] for _ in range(conversations)]
        asked = [[next(q) for _ in range(turns)] for _ in range(conversations)]
        outs = {}
        for name, eng in engines.items():
            eng.reset_prefix_cache()
            r = _run(eng, shared, output_len, f"s{it}{name}")
            runs[("shared", name)].append(r)
            outs.setdefault("shared", []).append(r["tokens"])
            r = _run(eng, distinct[it * num_prompts:(it + 1) * num_prompts], output_len, f"d{it}{name}")
            runs[("distinct", name)].append(r)
            log(f"  iter {it} {name}: shared {runs[('shared', name)][-1]['duration']:.2f}s, "
                f"distinct {r['duration']:.2f}s")
        for t in range(turns):
            prompts = [chats[c] + asked[c][t] for c in range(conversations)]
            answers = None
            for name, eng in engines.items():
                r = _run(eng, prompts, output_len, f"c{it}t{t}{name}")
                runs[(f"chat_turn{t + 1}", name)].append(r)
                same_tokens &= answers is None or r["tokens"] == answers
                answers = r["tokens"]
            chats = [p + a for p, a in zip(prompts, answers)]
        same_tokens &= outs["shared"][0] == outs["shared"][1]
    rows = {w: {name: _summary(runs[(w, name)]) for name in engines}
            for w in ["shared", "distinct"] + [f"chat_turn{t + 1}" for t in range(turns)]}
    return dict(rows=rows, same_tokens=same_tokens, k=k, num_prompts=num_prompts, system_len=system_len,
                question_len=question_len, output_len=output_len, turns=turns, conversations=conversations)


def table(res: dict) -> list[str]:
    out = ["| workload | TTFT median on / off (ms) | TTFT p99 on / off (ms) | output tok/s on / off | ratio | "
           "prompt tokens hit (on) | acceptance on / off |", "|---|---|---|---|---|---|---|"]
    for w, by in res["rows"].items():
        on, off = by["cache_on"], by["cache_off"]
        out.append(f"| {w} | {on['ttft_ms']['median']:.0f} / {off['ttft_ms']['median']:.0f} | "
                   f"{on['ttft_ms']['p99']:.0f} / {off['ttft_ms']['p99']:.0f} | {on['output_tokens_per_s']:.0f} / "
                   f"{off['output_tokens_per_s']:.0f} | {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x "
                   f"| {on['hit_tokens'] / max(on['prompt_tokens'], 1):.0%} | {on['acceptance_rate']:.3f} / "
                   f"{off['acceptance_rate']:.3f} |")
    out.append(f"same tokens with the cache on and off: {res['same_tokens']}")
    return out
