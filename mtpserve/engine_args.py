"""The engine's command-line flags, defined once for `mtpserve generate`, `mtpserve serve`, `mtpserve bench` (and
the tests): vLLM's names, engine keyword arguments out."""
import argparse
import json


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_model_args(p: argparse.ArgumentParser,
                   model_help: str = "HF DeepSeek-V3 checkpoint directory (default: the shipped model)") -> None:
    """The checkpoint, the speculation and the dtype (every engine-building command has them)."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--speculative-config", default=None, type=json_object,
                   help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\': MTP drafts up to 2 tokens a '
                        'step, as many as pay (adaptive; add "adaptive": false for always 2) (default: no speculation)')
    p.add_argument("--dtype", default="auto",
                   help="activations and weights: float32, bfloat16, float16 (default: bfloat16 on CUDA; on the CPU "
                        "the checkpoint's bfloat16 where mtpserve's bf16 kernels run, else float32; bfloat16 with "
                        "--quantization int8)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags in groups (--help prints them so; docs/configuration.md is generated from them)."""
    model = p.add_argument_group("model and speculation")
    add_model_args(model)
    add_quantization_arg(model)
    sched = p.add_argument_group("scheduling and KV cache")
    sched.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    sched.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per step, prompt chunks included (default: the engine's, 2048)")
    sched.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + output tokens of a request (default: the model's max_position_embeddings)")
    sched.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV-cache blocks (default: sized from memory, capped by what max-num-seqs can use)")
    sched.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    sched.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV blocks of prompts' shared prefixes, main and MTP layers (default: on)")
    sched.add_argument("--seed", type=int, default=0, help="the engine's random stream (unseeded requests)")
    run = p.add_argument_group("execution")
    run.add_argument("--device", default="auto", help="cpu or cuda (default: cuda when available)")
    add_graph_args(run)
    run.add_argument("--overlap", action="store_true",
                     help="run each step on a model thread while the engine finishes the step before (one process)")
    run.add_argument("--cpu-threads", type=int, default=None,
                     help="torch threads per rank on the CPU (default: the node's cores divided among its ranks; "
                          "`serve`: one core fewer, left to the HTTP server)")
    add_parallel_args(p.add_argument_group("parallelism (tensor, data, expert; nodes)"))


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", "-q", default=None, choices=["fp8", "int8", "none"],
                   help="fp8: linear weights in FP8 in memory (an FP8 checkpoint is kept so by default; a bf16 one is "
                        "quantized as it loads); int8: weight-only int8 on the CPU with bf16 activations (not "
                        "lossless against bf16; MTP stays lossless against it); none: dequantize an FP8 checkpoint")


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


def add_graph_args(p: argparse.ArgumentParser, batch_sizes: bool = True) -> None:
    """Graph-mode flags, shared by generate, serve and bench (see graph_kwargs; bench sweeps set the graph batch
    sizes themselves: batch_sizes=False)."""
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never use graphs (default: CUDA graphs captured at start-up; on the CPU graphs compiled in "
                        "the background (--compile-in-background) by one process whose threads leave a core free, "
                        "as `serve`'s do; else eager, and in `bench`)")
    p.add_argument("--graph-mode", action="store_true",
                   help="graphs compiled at start-up, also on the CPU (seconds with a warm inductor cache, minutes "
                        "cold)")
    p.add_argument("--compile-in-background", action="store_true",
                   help="graph mode on the CPU: ready at once; each graph is compiled in a compiler process when a "
                        "step first needs it (eager until then); adaptive k times them again once built")
    if batch_sizes:
        p.add_argument("--graph-batch-sizes", default=None,
                       help="comma list (default: 1,2,4,8,16,32); fewer sizes compile faster")


def graph_kwargs(args) -> dict:
    """--graph-mode / --enforce-eager / --graph-batch-sizes as engine keyword arguments (generate and serve)."""
    if args.graph_mode and args.enforce_eager:
        raise SystemExit("--graph-mode and --enforce-eager: choose one")
    kw = dict(enforce_eager=False if args.graph_mode else args.enforce_eager)
    if args.compile_in_background:
        kw["compile_in_background"] = True
    if getattr(args, "graph_batch_sizes", None):
        kw["graph_batch_sizes"] = [int(b) for b in args.graph_batch_sizes.split(",")]
    return kw


def engine_kwargs(args) -> dict:
    kwargs = dict(model=args.model, speculative_config=args.speculative_config, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                  dtype=args.dtype, device=args.device, seed=args.seed, quantization=args.quantization,
                  overlap=args.overlap, cpu_threads=args.cpu_threads, enable_prefix_caching=args.enable_prefix_caching,
                  **graph_kwargs(args), **parallel_kwargs(args))
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs
