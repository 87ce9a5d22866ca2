"""`mtpserve bench quantization`: weight-only int8 against bf16 and fp32 weights of the same checkpoint.

Speed side by side (the same prompts, iterations interleaved): TPOT and tokens/s per batch size, without MTP and
with MTP k (fixed). Quality on held-out code the model never trained on (common.make_prompts): perplexity from
prompt logprobs, greedy agreement with bf16 (the share of output tokens before the first difference, and of
outputs equal throughout), MTP acceptance; and whether MTP's greedy output equals the same weights' without MTP
(it must: speculation is lossless with respect to the weights it runs on)."""
import math

from mtpserve.bench import common
from mtpserve.bench.latency import aggregate, build_engine, run_interleaved
from mtpserve.sampling_params import SamplingParams

WEIGHTS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"), "int8": dict(dtype="auto", quantization="int8")}


def run_quantization(model: str, k: int, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
                     enforce_eager: bool | None, ppl_windows: int = 8, ppl_len: int = 256, log=print) -> dict:
    from mtpserve.config import ModelConfig
    specs = {"no_mtp": None, f"mtp_k{k}": {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}}
    ppl_len = min(ppl_len, ModelConfig.from_pretrained(model).max_position_embeddings // 2)   # (tiny test models)
    engines = {}
    for wname, weights in WEIGHTS.items():
        for sname, spec in specs.items():
            extra = {key: v for key, v in weights.items() if key != "dtype"}
            engines[f"{wname}_{sname}"] = build_engine(model, spec, max(batch_sizes), max(input_len + output_len, ppl_len) + 8,
                                                       enforce_eager, weights["dtype"], graph_batch_sizes=batch_sizes,
                                                       **extra)
    runs = run_interleaved(engines, batch_sizes, input_len, output_len, num_iters, log=log)
    rows = []
    for bs in batch_sizes:
        bf16 = [t for r in runs[(bs, "bf16_no_mtp")] for t in r["tokens"]]
        for name in engines:
            wname, sname = name.split("_", 1)
            tokens = [t for r in runs[(bs, name)] for t in r["tokens"]]
            plain = [t for r in runs[(bs, f"{wname}_no_mtp")] for t in r["tokens"]]
            a = aggregate(runs[(bs, name)])
            rows.append(dict(batch_size=bs, weights=wname, spec=sname, tpot_ms=a["tpot_ms"]["median"],
                             output_tokens_per_s=a["output_tokens_per_s"],
                             mean_acceptance_length=a.get("mean_acceptance_length"),
                             agreement_with_bf16=_agreement(tokens, bf16), lossless=tokens == plain))
    windows = common.make_prompts(ppl_windows, ppl_len, next(iter(engines.values())).model_config.vocab_size,
                                  next(iter(engines.values())).tokenizer, seed=7)
    perplexity = {w: _perplexity(engines[f"{w}_no_mtp"], windows) for w in WEIGHTS}
    for eng in engines.values():
        eng.shutdown()
    return dict(k=k, input_len=input_len, output_len=output_len, num_iters=num_iters, rows=rows,
                perplexity=perplexity, perplexity_tokens=ppl_windows * (ppl_len - 1))


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of tokens before each output's first difference from the reference; share of equal outputs."""
    prefix = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(t)) for t, r in zip(tokens, reference)]
    return dict(prefix_share=sum(prefix) / sum(len(t) for t in tokens),
                equal_outputs=sum(t == r for t, r in zip(tokens, reference)) / len(tokens))


def _perplexity(engine, windows: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of every window token after the first (prompt logprobs)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    for i, w in enumerate(windows):
        engine.add_request(f"ppl{i}", None, w, params)
    total, count = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                for token, scores in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
                    total -= scores[token].logprob
                    count += 1
    return math.exp(total / count)


def table(res: dict) -> list[str]:
    lines = ["| batch | weights | spec | TPOT ms | tokens/s | acceptance length | tokens before first difference "
             "from bf16 | outputs equal to bf16 | MTP = no MTP |", "|" + "---|" * 9]
    for r in res["rows"]:
        acc = r["mean_acceptance_length"]
        lines.append(f"| {r['batch_size']} | {r['weights']} | {r['spec']} | {r['tpot_ms']:.2f} | "
                     f"{r['output_tokens_per_s']:.1f} | {'' if r['spec'] == 'no_mtp' else f'{acc:.2f}'} | "
                     f"{r['agreement_with_bf16']['prefix_share']:.3f} | {r['agreement_with_bf16']['equal_outputs']:.3f}"
                     f" | {r['lossless']} |")
    lines.append("")
    lines.append("perplexity on held-out code (" + str(res["perplexity_tokens"]) + " tokens): "
                 + ", ".join(f"{w} {p:.3f}" for w, p in res["perplexity"].items()))
    return lines


def from_args(args, path: str) -> dict:
    """`mtpserve bench quantization`."""
    res = run_quantization(path, args.k, common.parse_list(args.batch_sizes), args.input_len, args.output_len,
                           args.num_iters, args.enforce_eager)
    print("\n".join(table(res)))
    return res
