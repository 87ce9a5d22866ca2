"""Command line: mtpserve generate | serve | bench | train."""
import argparse
import logging
import sys
import time

from mtpserve.engine_args import add_engine_args, engine_kwargs

DEFAULT_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(root):",
                   "class Stack:\n    def __init__(self):"]


def run_generate(args) -> None:
    from mtpserve import LLM, SamplingParams
    from mtpserve.engine.setup import engine_config, run_non_front_ranks
    if run_non_front_ranks(engine_config(**engine_kwargs(args))):
        return   # this node's ranks served the front until it stopped
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                            presence_penalty=args.presence_penalty, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print(f"--- prompt: {out.prompt!r}\n{out.prompt}{out.outputs[0].text}\n")
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tok/s)")
    m = llm.get_metrics()
    if args.enable_prefix_caching:
        print(f"prefix cache: {m['prefix_cache_hits']} of {m['prefix_cache_queries']} prompt tokens hit "
              f"({m['prefix_cache_hit_rate']:.1%})")
    if args.speculative_config:
        per_pos = ", ".join(f"{a / max(d, 1):.2f}"
                            for a, d in zip(m["accepted_per_position"], m["drafted_per_position"]))
        print(f"speculation: acceptance rate {m['acceptance_rate']:.3f}, "
              f"mean acceptance length {m['mean_acceptance_length']:.2f}, accepted per position [{per_pos}]"
              + (f", steps by k drafted {m['draft_steps_by_k']} (adaptive)" if "draft_steps_by_k" in m else ""))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline")
    add_engine_args(gen)
    g = gen.add_argument_group("prompts and sampling (SamplingParams' fields)").add_argument
    g("--prompt", action="append", help="a prompt (repeatable); default: a few Python openings")
    g("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    g("--temperature", type=float, default=0.0, help="0: greedy")
    g("--top-p", type=float, default=1.0, help="nucleus: the smallest set of tokens with this much probability")
    g("--top-k", type=int, default=-1, help="the k most likely tokens only (-1: all)")
    g("--min-p", type=float, default=0.0, help="tokens at least this fraction of the most likely one's probability")
    g("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    g("--frequency-penalty", type=float, default=0.0, help="subtracted per earlier occurrence of a token")
    g("--presence-penalty", type=float, default=0.0, help="subtracted once from every token seen")
    g("--sampling-seed", type=int, default=None, help="the requests' seed (reproducible sampling)")
    gen.set_defaults(func=run_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from mtpserve.serve.server import add_serve_args, run_server
    add_serve_args(serve)
    serve.set_defaults(func=run_server)

    proxy = sub.add_parser("proxy", help="OpenAI-compatible front for disaggregated prefill / decode servers")
    from mtpserve.disagg.proxy import add_proxy_args, run_proxy
    add_proxy_args(proxy)
    proxy.set_defaults(func=run_proxy)
    train = sub.add_parser("train", help="train a DeepSeek-V3 + MTP model on Python source (the stdlib, or many projects)")
    from mtpserve.train.train import add_train_args, run_train
    add_train_args(train)
    train.set_defaults(func=run_train)

    vocab = sub.add_parser("draft-vocab", help="count token frequencies for a frequency-ranked draft vocabulary")
    from mtpserve.spec_decode.draft_vocab import add_draft_vocab_args, run_draft_vocab
    add_draft_vocab_args(vocab)
    vocab.set_defaults(func=run_draft_vocab)

    try:
        from mtpserve.bench.cli import add_bench_args, run_bench
        bench = sub.add_parser("bench", help="latency / throughput / serving benchmarks")
        add_bench_args(bench)
        bench.set_defaults(func=run_bench)
    except ImportError:
        pass

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
