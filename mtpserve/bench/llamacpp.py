"""llama.cpp as a measured peer (`mtpserve bench peers --peers llamacpp`), side by side with mtpserve on the
same checkpoint, threads and dtype: f32 vs float32, bf16 vs bfloat16, Q8_0 vs our weight-only int8.

llama.cpp is built outside the repository by scripts/build_llamacpp.sh (its directory: $MTPSERVE_LLAMACPP_DIR,
default ~/.cache/mtpserve/llama.cpp); the checkpoint is converted by its own converter (bench/gguf_convert.py),
once per dtype, into that directory. Their side: `llama-bench` (pp512, pp2048, tg) and `llama-batched-bench`
(batched decode). Our side: the same prompt lengths through LLM engines (prompt tokens/s from one-token
requests), decode tokens/s = 1 / TPOT at batch 1 and batch / TPOT when batched, with and without MTP."""
import json
import os
import subprocess
import sys
import time

from mtpserve.bench import common
from mtpserve.bench.latency import aggregate, build_engine, run_batch, run_interleaved, spec_dict

# our dtype flags -> (their GGUF type, our engine keyword arguments)
PAIRS = {"float32": ("f32", dict(dtype="float32")), "bfloat16": ("bf16", dict(dtype="bfloat16")),
         "int8": ("q8_0", dict(dtype="auto", quantization="int8"))}


def llamacpp_dir() -> str:
    return os.environ.get("MTPSERVE_LLAMACPP_DIR", os.path.expanduser("~/.cache/mtpserve/llama.cpp"))


def tool(name: str) -> str | None:
    path = os.path.join(llamacpp_dir(), "build", "bin", name)
    return path if os.access(path, os.X_OK) else None


def missing() -> str | None:
    """Why the peer cannot run here, or None."""
    absent = [t for t in ("llama-bench", "llama-batched-bench") if tool(t) is None]
    if absent:
        return (f"llama.cpp not built ({', '.join(absent)} missing under {llamacpp_dir()}/build/bin): "
                "run scripts/build_llamacpp.sh once (it caches the build outside the repository)")
    return None


def gguf_file(checkpoint: str, outtype: str) -> str:
    """The checkpoint converted to `outtype` (cached; converted again when the checkpoint is newer)."""
    weights = os.path.join(checkpoint, "model.safetensors")
    out = os.path.join(llamacpp_dir(), "gguf", f"{os.path.basename(os.path.abspath(checkpoint))}-{outtype}.gguf")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(weights):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        subprocess.run([sys.executable, "-m", "mtpserve.bench.gguf_convert", llamacpp_dir(), checkpoint, out, outtype],
                       check=True, capture_output=True)
    return out


def llama_bench(gguf: str, threads: int, prompt_lens: list[int], gen_len: int, reps: int, repack: bool = True) -> dict:
    """-> {"pp512": tok/s, "pp2048": tok/s, "tg128": tok/s}: llama-bench's mean over `reps` repetitions."""
    out = subprocess.run([tool("llama-bench"), "-m", gguf, "-t", str(threads), "-p", ",".join(map(str, prompt_lens)),
                          "-n", str(gen_len), "-r", str(reps), "-o", "json", "--repack", str(int(repack))],
                         check=True, capture_output=True, text=True)
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): r["avg_ts"] for r in json.loads(out.stdout)}


def batched_bench(gguf: str, threads: int, batch_sizes: list[int], prompt_len: int, gen_len: int,
                  repack: bool = True) -> dict:
    """-> {batch: decode tok/s over all sequences}: llama-batched-bench, one prompt per sequence."""
    ctx = max(batch_sizes) * (prompt_len + gen_len) + 64
    out = subprocess.run([tool("llama-batched-bench"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
                          "-c", str(ctx), "-npp", str(prompt_len), "-ntg", str(gen_len),
                          "-npl", ",".join(map(str, batch_sizes)), "--output-format", "jsonl"]
                         + ([] if repack else ["--no-repack"]), check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith('{"n_kv_max"')]
    return {r["pl"]: r["speed_tg"] for r in rows}


def our_prompt_speed(engine, prompt_len: int, reps: int) -> float:
    """Prompt tokens/s: a request of `prompt_len` held-out tokens and max_tokens 1, timed to its end."""
    prompts = common.make_prompts(reps, prompt_len, engine.model_config.vocab_size, engine.tokenizer, seed=11)
    seconds = [run_batch(engine, [p], 1, tag=f"pp{i}")["duration"] for i, p in enumerate(prompts)]
    return prompt_len / min(seconds)


def run_llamacpp(model: str, dtypes: list[str], ks: list[int], adaptive: bool, batch_sizes: list[int],
                 prompt_lens: list[int], input_len: int, output_len: int, num_iters: int, threads: int,
                 enforce_eager: bool | None, draft_vocab: int = 0, log=print) -> dict:
    """Per dtype: llama.cpp, then ours, then llama.cpp again (their figures: the mean of the two runs). draft_vocab:
    our MTP engines draft over that many most frequent tokens (0: the whole vocabulary)."""
    if 0 not in ks:   # (before minutes of building: our prompt speed is the engine's without speculation)
        raise SystemExit(f"--ks {','.join(map(str, ks))}: must include 0 (prompts are timed without speculation)")
    from mtpserve.config import ModelConfig
    positions = ModelConfig.from_pretrained(model).max_position_embeddings
    longest = max([n + 1 for n in prompt_lens] + [input_len + output_len])
    max_len = min(longest, positions - max(ks) - 8)   # (build_engine's headroom)
    # a 2,048-token prompt in a model of 2,048 positions: ours gets the longest that leaves room to generate
    our_lens = [min(n, max_len - 1) for n in prompt_lens]
    dv = f"_dv{draft_vocab}" if draft_vocab else ""
    specs = {("no_mtp" if k == 0 else f"mtp_k{k}{dv}"): spec_dict(k, "mqa", None, None, draft_vocab) for k in ks}
    if adaptive:
        specs[f"adaptive_k{max(ks)}{dv}"] = dict(spec_dict(max(ks), "mqa", None, None, draft_vocab), adaptive=True)
    rows = []
    for dtype in dtypes:
        outtype, weights = PAIRS[dtype]
        gguf = gguf_file(model, outtype)
        theirs = [_theirs(gguf, threads, prompt_lens, output_len, batch_sizes, num_iters, log)]
        engines = {name: build_engine(model, spec, max(batch_sizes), max_len, enforce_eager,
                                      graph_batch_sizes=batch_sizes, **weights) for name, spec in specs.items()}
        start = time.perf_counter()
        runs = run_interleaved(engines, batch_sizes, input_len, output_len, num_iters, log=log)
        ours = {name: {str(bs): _decode_speed(aggregate(runs[(bs, name)]), bs) for bs in batch_sizes}
                for name in engines}
        pp = {f"pp{n}": our_prompt_speed(engines["no_mtp"], mine, num_iters) for n, mine in zip(prompt_lens, our_lens)}
        log(f"  ours {dtype}: {time.perf_counter() - start:.0f} s")
        for eng in engines.values():
            eng.shutdown()
        theirs.append(_theirs(gguf, threads, prompt_lens, output_len, batch_sizes, num_iters, log))
        repacked = all(t["repacked"] for t in theirs)
        rows.append(dict(dtype=dtype, gguf_type=outtype if repacked else f"{outtype} (not repacked)", ours=ours,
                         ours_prompt=pp, llamacpp=_mean(theirs)))
    return dict(threads=threads, input_len=input_len, output_len=output_len, batch_sizes=batch_sizes,
                prompt_lens=prompt_lens, our_prompt_lens=our_lens, num_iters=num_iters, draft_vocab_size=draft_vocab,
                rows=rows)


def _theirs(gguf: str, threads: int, prompt_lens: list[int], gen_len: int, batch_sizes: list[int], reps: int,
            log) -> dict:
    repack = True
    try:
        one = llama_bench(gguf, threads, prompt_lens, gen_len, reps)
    except subprocess.CalledProcessError as e:
        if e.returncode >= 0:
            raise
        # killed by an assertion: llama.cpp's weight repacking fails on some CPUs (Q8_0 on an AMX CPU, 2026-12-05:
        # GGML_ASSERT in ggml-backend.cpp); measured without it, and the row says so
        log(f"  llama.cpp {os.path.basename(gguf)}: llama-bench aborted ({e.returncode}); again without repacking")
        repack = False
        one = llama_bench(gguf, threads, prompt_lens, gen_len, reps, repack=False)
    many = [b for b in batch_sizes if b > 1]
    batched = batched_bench(gguf, threads, many, 32, gen_len, repack) if many else {}
    log(f"  llama.cpp {os.path.basename(gguf)}: {one} batched {batched}")
    return dict(one, **{f"batch{b}": v for b, v in batched.items()}, repacked=float(repack))


def _mean(runs: list[dict]) -> dict:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def _decode_speed(agg: dict, batch: int) -> dict:
    """Decode tokens/s (the first token excluded: llama.cpp's tg excludes the prompt too)."""
    return dict(tokens_per_s=batch * agg["decode_tokens_per_s_per_request"],
                mean_acceptance_length=agg.get("mean_acceptance_length"))


def table(res: dict) -> list[str]:
    bs = res["batch_sizes"]
    ours_names = list(res["rows"][0]["ours"])
    head = ["dtype (ours / llama.cpp)"] + [f"prompt {n} tok/s" for n in res["prompt_lens"]] + \
        [f"batch {b} decode tok/s" for b in bs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        t = r["llamacpp"]
        lines.append(f"| llama.cpp {r['gguf_type']} | " + " | ".join(
            [f"{t[f'pp{n}']:.0f}" for n in res["prompt_lens"]] +
            [f"{their_decode(t, b, res):.1f}" for b in bs]) + " |")
        for name in ours_names:
            o = r["ours"][name]
            pp = [f"{r['ours_prompt'][f'pp{n}']:.0f} ({r['ours_prompt'][f'pp{n}'] / t[f'pp{n}']:.2f}x)"
                  if name == "no_mtp" else "" for n in res["prompt_lens"]]
            dec = [f"{o[str(b)]['tokens_per_s']:.1f} ({o[str(b)]['tokens_per_s'] / their_decode(t, b, res):.2f}x)"
                   for b in bs]
            lines.append(f"| mtpserve {r['dtype']} {name} | " + " | ".join(pp + dec) + " |")
    return lines


def notes(res: dict) -> str:
    """What a table's engines did apart from the defaults, each after a "; "."""
    cut = [f"; our prompts hold {mine} for {n} tokens, as many as the engine's positions hold with room to generate"
           for n, mine in zip(res["prompt_lens"], res["our_prompt_lens"]) if mine != n]
    dv, wide = res.get("draft_vocab_size"), res.get("widened")
    return "".join(cut + ([f"; MTP drafts over the {dv} most frequent tokens"] if dv else [])
                   + ([f"; not the shipped model: a random checkpoint of its layout {wide}x as wide (`--widen`), "
                       f"{wide * wide}x its weights"] if wide else []))


def their_decode(t: dict, batch: int, res: dict) -> float:
    """llama.cpp's decode tokens/s at this batch size (llama-bench's tg at 1, llama-batched-bench above)."""
    return t[f"tg{res['output_len']}"] if batch == 1 else t[f"batch{batch}"]


def summary(res: dict) -> str:
    """One line per question, from the ratios (ours / llama.cpp, same dtype)."""
    parts = []
    for b in res["batch_sizes"]:
        plain = [r["ours"]["no_mtp"][str(b)]["tokens_per_s"] / their_decode(r["llamacpp"], b, res)
                 for r in res["rows"]]
        best = [max(o[str(b)]["tokens_per_s"] for o in r["ours"].values()) / their_decode(r["llamacpp"], b, res)
                for r in res["rows"]]
        parts.append(f"batch {b} decode, ours / llama.cpp: {_span(plain)} without speculation, {_span(best)} with "
                     "the best of our engines")
    for n in res["prompt_lens"]:
        pp = [r["ours_prompt"][f"pp{n}"] / r["llamacpp"][f"pp{n}"] for r in res["rows"]]
        parts.append(f"{n}-token prompts {_span(pp)}")
    return "; ".join(parts) + " (ranges over " + ", ".join(r["dtype"] for r in res["rows"]) + ")."


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"
