"""Command line: mtpserve generate | serve | bench | train."""
import argparse
import json
import logging
import sys
import time

DEFAULT_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(root):",
                   "class Stack:\n    def __init__(self):"]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF DeepSeek-V3 checkpoint directory (default: the shipped model)")
    p.add_argument("--speculative-config", default=None, type=json.loads,
                   help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'')
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    add_quantization_arg(p)
    p.add_argument("--device", default="auto")
    add_graph_args(p)
    add_parallel_args(p)
    p.add_argument("--seed", type=int, default=0)


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", "-q", default=None, choices=["fp8", "none"],
                   help="fp8: linear weights in FP8 in memory (an FP8 checkpoint is kept so by default; a bf16 one is "
                        "quantized as it loads); none: dequantize an FP8 checkpoint")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor / data / expert parallelism and multi-node flags (vLLM's / torchrun's names), shared by generate,
    serve, bench."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks, one process each (spawned here; or started by torchrun)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="data-parallel ranks (engine cores: own scheduler and KV cache each), one process each")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="routed experts partitioned over all ranks (tokens dispatched to their experts' ranks)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the ranks are split over (run the same command on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node (0 runs the engine and the server)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (rendezvous)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one; single node)")


def parallel_kwargs(args) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                enable_expert_parallel=args.enable_expert_parallel, nnodes=args.nnodes, node_rank=args.node_rank,
                master_addr=args.master_addr, master_port=args.master_port)


def add_graph_args(p: argparse.ArgumentParser) -> None:
    """Graph-mode flags, shared by generate and serve (see graph_kwargs)."""
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never use graphs (default: graphs on CUDA, eager on CPU)")
    p.add_argument("--graph-mode", action="store_true",
                   help="compiled decode steps also on the CPU (faster decode; ~10-100 s of compiling at start-up)")
    p.add_argument("--graph-batch-sizes", default=None,
                   help="comma list (default: 1,2,4,8,16,32); fewer sizes compile faster")


def graph_kwargs(args) -> dict:
    """--graph-mode / --enforce-eager / --graph-batch-sizes as engine keyword arguments (generate and serve)."""
    if args.graph_mode and args.enforce_eager:
        raise SystemExit("--graph-mode and --enforce-eager: choose one")
    kw = dict(enforce_eager=False if args.graph_mode else args.enforce_eager)
    if args.graph_batch_sizes:
        kw["graph_batch_sizes"] = [int(b) for b in args.graph_batch_sizes.split(",")]
    return kw


def engine_kwargs(args) -> dict:
    return dict(model=args.model, speculative_config=args.speculative_config, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, dtype=args.dtype,
                device=args.device, seed=args.seed, quantization=args.quantization, **graph_kwargs(args),
                **parallel_kwargs(args))


def run_generate(args) -> None:
    from mtpserve import LLM, SamplingParams
    from mtpserve.engine.setup import engine_config, run_non_front_ranks
    if run_non_front_ranks(engine_config(**engine_kwargs(args))):
        return   # this node's ranks served the front until it stopped
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print(f"--- prompt: {out.prompt!r}\n{out.prompt}{out.outputs[0].text}\n")
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tok/s)")
    if args.speculative_config:
        m = llm.get_metrics()
        per_pos = ", ".join(f"{a / max(m['num_drafts'], 1):.2f}" for a in m["accepted_per_position"])
        print(f"speculation: acceptance rate {m['acceptance_rate']:.3f}, "
              f"mean acceptance length {m['mean_acceptance_length']:.2f}, accepted per position [{per_pos}]")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few Python openings")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=run_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from mtpserve.serve.server import add_serve_args, run_server
    add_serve_args(serve)
    serve.set_defaults(func=run_server)

    proxy = sub.add_parser("proxy", help="OpenAI-compatible front for disaggregated prefill / decode servers")
    from mtpserve.disagg.proxy import add_proxy_args, run_proxy
    add_proxy_args(proxy)
    proxy.set_defaults(func=run_proxy)
    train = sub.add_parser("train", help="train a DeepSeek-V3 + MTP model on the standard library's source")
    from mtpserve.train.train import add_train_args, run_train
    add_train_args(train)
    train.set_defaults(func=run_train)

    vocab = sub.add_parser("draft-vocab", help="count token frequencies for a frequency-ranked draft vocabulary")
    from mtpserve.spec.draft_vocab import add_draft_vocab_args, run_draft_vocab
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
