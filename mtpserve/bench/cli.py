"""`mtpserve bench {latency,throughput,serve,peers,roofline,quantization,report,...}` (flags follow `vllm bench`)."""
import argparse
import time

from mtpserve.bench import common
from mtpserve.bench.peers import from_args as _peers  # noqa: F401 (run_bench dispatches by name)
from mtpserve.bench.quantization import from_args as _quantization  # noqa: F401
from mtpserve.bench.startup import from_args as _startup  # noqa: F401
from mtpserve.engine_args import add_graph_args, add_model_args, add_quantization_arg, graph_kwargs


def _common(p: argparse.ArgumentParser, input_len: int = 32, output_len: int = 64) -> None:
    add_model_args(p, "checkpoint dir (default: the shipped model; while it is absent, a random stand-in checkpoint "
                      "written under --scratch-dir)")
    add_graph_args(p, batch_sizes=False)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-json", default=None)
    p.add_argument("--scratch-dir", default="runs/bench")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the engines' prefix cache (default: on, as the engine; repeated iterations then hit it)")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    lat = sub.add_parser("latency", help="ITL/TPOT/acceptance over batch sizes x k x scorers, side by side")
    _common(lat)
    lat.add_argument("--batch-sizes", default=None, help="comma list, e.g. 1,8,32 (default: --batch-size)")
    lat.add_argument("--ks", default=None, help="comma list of num_speculative_tokens, 0 = no MTP (default: 0 and "
                                                "the --speculative-config k)")
    lat.add_argument("--scorers", default="mqa", help="comma list of mqa,batch_expansion")
    lat.add_argument("--modes", default=None,
                     help="comma list of eager,graph: run both side by side (default: the one mode chosen)")
    lat.add_argument("--synthetic-acceptance", type=float, default=None,
                     help="MEASUREMENT MODE: each draft passes with this fixed probability (output not lossless)")
    lat.add_argument("--draft-vocab-sizes", default=None,
                     help="comma list of speculative_config.draft_vocab_size per MTP config, 0 = the whole vocabulary")
    lat.add_argument("--plot-dir", default=None, help="write PNG plots here")
    ad = sub.add_parser("adaptive", help="adaptive speculation length vs every fixed k and no MTP, side by side")
    _common(ad)
    ad.add_argument("--max-k", type=int, default=3)
    ad.add_argument("--batch-sizes", default="1,8,32,64", help="comma list")
    ad.add_argument("--lockstep", action="store_true",
                    help="the engines step in turns over each batch, each timed by its own steps (less drift noise)")
    fu = sub.add_parser("fused", help="graph mode: the fused speculative step vs separate graphs vs no MTP, side by side")
    _common(fu)
    fu.add_argument("--ks", default="1,2", help="comma list of num_speculative_tokens")
    fu.add_argument("--batch-sizes", default="1,8", help="comma list")
    fu.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: seeded sampling requests (the same tokens with and without MTP) instead of greedy")
    sa = sub.add_parser("sampling", help="sampling fields (logprobs, penalties) with and without MTP, side by side")
    _common(sa)
    sa.add_argument("--k", type=int, default=2)
    sa.add_argument("--batch-sizes", default="1,32", help="comma list")
    qu = sub.add_parser("quantization", help="int8 vs bf16 vs fp32 weights: speed with and without MTP, quality")
    _common(qu)
    qu.add_argument("--k", type=int, default=2)
    qu.add_argument("--batch-sizes", default="1,8", help="comma list")
    px = sub.add_parser("prefix", help="the prefix cache on vs off: a shared system prompt, multi-turn chat, and "
                                       "prompts sharing nothing, MTP on")
    _common(px, 32, 64)
    px.add_argument("--system-len", type=int, default=1024)
    px.add_argument("--turns", type=int, default=5)
    px.add_argument("--conversations", type=int, default=8)
    px.add_argument("--k", type=int, default=2)
    ov = sub.add_parser("overlap", help="overlap (a model thread) on vs off, side by side")
    _common(ov)
    ov.add_argument("--ks", default="0,1", help="comma list of num_speculative_tokens, 0 = no MTP")
    ov.add_argument("--batch-sizes", default="1,8,32", help="comma list")
    ov.add_argument("--modes", default="eager,graph", help="comma list of eager,graph")
    tp = sub.add_parser("throughput", help="many prompts offline: tokens/s and requests/s")
    _common(tp, 32, 64)
    tp.add_argument("--max-num-seqs", type=int, default=64)
    tp.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks (worker processes)")
    sv = sub.add_parser("serve", help="concurrent streaming clients against a running `mtpserve serve`")
    _common(sv, 32, 64)
    sv.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="the 'model' field (default: the server's first)")
    sv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    sv.add_argument("--fixed-rate", action="store_true", help="fixed intervals instead of Poisson arrivals")
    sv.add_argument("--max-concurrency", type=int, default=None)
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--server-command", default=None,
                    help="how the server at --base-url was started (another engine's, say): kept in the results")
    st = sub.add_parser("startup", help="`serve --graph-mode`: time to ready and decode speed after, graphs "
                                        "compiled at start-up vs in the background, cold and warm inductor cache")
    _common(st, 32, 64)
    st.add_argument("--duration", type=float, default=150, help="seconds of requests after ready")
    st.add_argument("--timeout", type=float, default=600, help="seconds to wait for ready")
    st.add_argument("--graph-batch-sizes", default=None, help="comma list (default: the engine's)")
    st.add_argument("--modes", default="background,startup", help="when graphs compile: comma list")
    pe = sub.add_parser("peers", help="our engine vs transformers generate and llama.cpp on the same checkpoint")
    _common(pe, 32, 64)
    pe.add_argument("--peers", default="transformers", help="comma list of transformers,llamacpp")
    pe.add_argument("--k", type=int, default=1, help="our MTP k for the comparison (0: none)")
    pe.add_argument("--no-hf-mtp", action="store_true", help="skip transformers generate(use_mtp=True)")
    pe.add_argument("--dtypes", default="float32,bfloat16,int8",
                    help="llamacpp: our dtypes, each against its GGUF twin (f32, bf16, Q8_0 for int8)")
    pe.add_argument("--ks", default="0,1,2", help="llamacpp: our fixed k per engine, 0 = no MTP")
    pe.add_argument("--adaptive", action="store_true", help="llamacpp: also adaptive k up to the largest --ks")
    pe.add_argument("--batch-sizes", default="1,8,32", help="llamacpp: decode batch sizes")
    pe.add_argument("--prompt-lens", default="512,2048", help="llamacpp: prompt-processing lengths")
    pe.add_argument("--draft-vocab-size", type=int, default=0, help="llamacpp: our MTP engines draft over the N most "
                    "frequent tokens (speculative_config.draft_vocab_size; 0: the whole vocabulary)")
    pe.add_argument("--widen", type=int, default=0, help="llamacpp: instead of --model, a random checkpoint of the "
                    "shipped model's layout N times as wide (weights N^2 times as large); random drafts: --ks 0 only")
    rf = sub.add_parser("roofline", help="bandwidth floor of a batch-1 step vs the measured step, plain and with "
                                         "k drafts")
    _common(rf, 32, 64)
    rf.add_argument("--ks", default="0,1", help="comma list of num_speculative_tokens, 0 = no MTP")
    rf.add_argument("--random-dense", action="store_true", help="a random ~300M dense model instead of --model")
    add_quantization_arg(rf)
    pa = sub.add_parser("parallel", help="parallel layouts side by side (same cores), and what their collectives cost")
    _common(pa, 32, 64)
    pa.add_argument("--layouts", default="tp1,tp2", help="comma list: tpN (tensor parallel), dpNep (data-parallel "
                    "attention + expert parallel), tpNep (TP with whole experts per rank)")
    pa.add_argument("--tensor-parallel-sizes", default=None, help="comma list: the same as --layouts tp1,tp2,...")
    pa.add_argument("--batch-sizes", default="1,32", help="comma list")
    add_quantization_arg(pa)
    ho = sub.add_parser("handoff", help="a decode server's first step after a hand-off: scheme 2 vs scheme 1")
    _common(ho, 256, 16)
    ho.add_argument("--k", type=int, default=1, help="num_speculative_tokens")
    sc = sub.add_parser("scaling", help="a checkpoint's layout over N devices (TP, DP+EP) from its config alone")
    sc.add_argument("--config", default="deepseek-v3", help="'deepseek-v3', a checkpoint dir or a config.json")
    sc.add_argument("--devices", default="8,16", help="comma list of device counts")
    sc.add_argument("--memory-gib", type=float, default=141.0, help="memory per device (H200: 141)")
    sc.add_argument("--fp8", action="store_true", help="FP8 linear weights (DeepSeek-V3's released format)")
    sc.add_argument("--batch", type=int, default=32, help="decode batch per device")
    rp = sub.add_parser("report", help="write docs/BENCHMARKS.md (and plots) from result JSON files")
    rp.add_argument("--results", nargs="+", required=True, help="result JSON files")
    rp.add_argument("--out", default="docs/BENCHMARKS.md")
    rp.add_argument("--plot-dir", default="docs/plots")


def run_bench(args) -> dict | None:
    if args.bench_command == "scaling":
        from mtpserve.bench import scaling
        cfg = scaling.load_config(args.config)
        print("\n".join(scaling.table(cfg, common.parse_list(args.devices), args.memory_gib, args.fp8, args.batch)))
        return None
    if args.bench_command == "report":
        from mtpserve.bench import report
        report.write_report(args.results, args.out, args.plot_dir)
        return None
    if hasattr(args, "graph_mode"):   # (one mode per measurement: eager on the CPU unless --graph-mode)
        args.enforce_eager = graph_kwargs(args)["enforce_eager"]
        if args.enforce_eager is None:
            import torch
            args.enforce_eager = not torch.cuda.is_available()
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    if hasattr(args, "enable_prefix_caching"):
        if not args.enable_prefix_caching and args.bench_command in ("prefix", "serve"):
            raise SystemExit(f"--no-enable-prefix-caching: not for bench {args.bench_command} (prefix runs the cache "
                             "on and off itself; serve measures a server: pass it to `mtpserve serve`)")
        from mtpserve.bench import latency
        latency.ENGINE_DEFAULTS["enable_prefix_caching"] = args.enable_prefix_caching
    record = common.run_record(args.bench_command, args)
    if args.bench_command == "serve":
        from mtpserve.bench import serve
        record["results"] = serve.from_args(args)
    else:
        if getattr(args, "random_dense", False):
            path, kind = None, "random dense (roofline)"
        elif getattr(args, "widen", 0):
            if args.adaptive or any(common.parse_list(args.ks)):   # (refused before a large checkpoint is written)
                raise SystemExit("--widen: its random MTP layers draft at random (acceptance ~0); pass --ks 0")
            path = common.widened_model(args.widen, args.scratch_dir)
            kind = f"random, the shipped model's layout {args.widen}x as wide"
        else:
            path, kind = common.resolve_model(args.model, args.scratch_dir)
        record["model_kind"] = kind
        if path is not None:
            record["model"] = common.model_info(path)
        record["results"] = globals()["_" + args.bench_command](args, path)
    record["measurement_mode"] = ("SYNTHETIC ACCEPTANCE (each draft passes with probability "
                                  f"{args.synthetic_acceptance}; output is not lossless)"
                                  if getattr(args, "synthetic_acceptance", None) is not None else "real")
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    common.write_json(record, args.output_json)
    if args.bench_command == "latency" and args.plot_dir:
        from mtpserve.bench import plots
        plots.plot_latency(record, args.plot_dir)
    return record


def _latency(args, path: str) -> dict:
    from mtpserve.bench import latency
    spec = args.speculative_config
    ks = common.parse_list(args.ks) if args.ks else sorted({0, spec["num_speculative_tokens"] if spec else 0})
    batch_sizes = common.parse_list(args.batch_sizes) if args.batch_sizes else [args.batch_size]
    scorers = common.parse_list(args.scorers, str)
    if args.synthetic_acceptance is not None:
        print(f"MEASUREMENT MODE: synthetic acceptance {args.synthetic_acceptance} (not lossless)")
    res = latency.sweep(path, batch_sizes, ks, scorers, args.input_len, args.output_len, args.num_iters,
                        args.enforce_eager, args.dtype, spec, args.synthetic_acceptance,
                        modes=common.parse_list(args.modes, str) if args.modes else None,
                        draft_vocab_sizes=common.parse_list(args.draft_vocab_sizes) if args.draft_vocab_sizes else None)
    latency.print_table(res["configs"])
    return res


def _adaptive(args, path: str) -> dict:
    from mtpserve.bench import adaptive
    res = adaptive.run_adaptive(path, args.max_k, common.parse_list(args.batch_sizes), args.input_len, args.output_len,
                                args.num_iters, args.enforce_eager, args.dtype, lockstep=args.lockstep)
    print("\n".join(adaptive.table(res)))
    return res


def _prefix(args, path: str) -> dict:
    from mtpserve.bench import prefix
    res = prefix.run_prefix(path, args.num_prompts, args.system_len, args.input_len, args.output_len, args.turns,
                            args.conversations, args.num_iters, args.k, args.dtype)
    print("\n".join(prefix.table(res)))
    return res


def _sampling(args, path: str) -> dict:
    from mtpserve.bench import sampling
    res = sampling.run_sampling(path, args.k, common.parse_list(args.batch_sizes), args.input_len, args.output_len,
                                args.num_iters, args.enforce_eager, args.dtype)
    print("\n".join(sampling.table(res)))
    return res


def _fused(args, path: str) -> dict:
    from mtpserve.bench import fused
    res = fused.run_fused(path, common.parse_list(args.ks), common.parse_list(args.batch_sizes), args.input_len,
                          args.output_len, args.num_iters, args.dtype, args.temperature, args.speculative_config,
                          enforce_eager=bool(args.enforce_eager))
    print("\n".join(fused.table(res)))
    return res


def _overlap(args, path: str) -> dict:
    from mtpserve.bench import overlap
    res = overlap.run_overlap(path, common.parse_list(args.ks), common.parse_list(args.batch_sizes),
                              common.parse_list(args.modes, str), args.input_len, args.output_len, args.num_iters,
                              args.dtype)
    print("\n".join(overlap.table(res)))
    return res


def _throughput(args, path: str) -> dict:
    from mtpserve.bench import throughput
    res = throughput.run_throughput(path, args.speculative_config, args.num_prompts, args.input_len,
                                    args.output_len, args.max_num_seqs, args.enforce_eager, args.dtype,
                                    args.tensor_parallel_size)
    print(f"Throughput: {res['requests_per_s']:.2f} requests/s, {res['output_tokens_per_s']:.1f} output tokens/s, "
          f"{res['total_tokens_per_s']:.1f} total tokens/s ({res['num_prompts']} prompts in {res['elapsed_s']:.2f}s)")
    return res


def _parallel(args, path: str) -> dict:
    import os

    from mtpserve.bench import parallel
    layouts = args.layouts.split(",")
    if args.tensor_parallel_sizes:
        layouts = [f"tp{n}" for n in common.parse_list(args.tensor_parallel_sizes)]
    res = parallel.run_parallel(path, layouts, common.parse_list(args.batch_sizes),
                                args.input_len, args.output_len, args.num_iters, args.dtype, args.speculative_config,
                                args.threads or os.cpu_count() or 1, args.quantization)
    parallel.print_parallel(res)
    return res


def _handoff(args, path: str) -> dict:
    from mtpserve.bench import handoff
    dtype = "float32" if args.dtype == "auto" else args.dtype
    res = handoff.run_handoff(path, args.k, args.batch_size, args.input_len, args.num_iters, dtype)
    handoff.print_handoff(res)
    return res


def _roofline(args, path: str | None) -> dict:
    from mtpserve.bench import roofline
    res = roofline.run_roofline(path, args.input_len, args.output_len, args.num_iters, args.scratch_dir,
                                args.enforce_eager, "float32" if args.dtype == "auto" else args.dtype,
                                args.quantization, common.parse_list(args.ks))
    print("\n".join(roofline.table(res)))
    return res
