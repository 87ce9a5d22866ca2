"""`mtpserve bench parallel`: parallel layouts side by side on one machine (same cores in all: one process with
all the threads, N ranks with one Nth each): tensor parallelism (tpN), data-parallel attention with expert
parallelism (dpNep), plus what their collectives cost here: the all-reduce a TP step makes twice per layer,
the step hand-off, and the two ways to dispatch tokens to experts (all-gather + reduce-scatter, all-to-all)."""
import re
import time

import torch
import torch.multiprocessing as mp

from mtpserve.bench import common
from mtpserve.bench.latency import ENGINE_DEFAULTS

MiB = 2 ** 20
# The ~300M benchmark model with mixture-of-experts layers (8 routed experts, top-2, one shared), for DP+EP.
MOE_SIZES = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=256,
                 qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, moe_intermediate_size=512, n_group=1, topk_group=1, first_k_dense_replace=1,
                 max_position_embeddings=1024, num_nextn_predict_layers=1)


def _time_allreduce(rank: int, port: int, shapes: list, dtype: torch.dtype, iters: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = {}
    for shape in shapes:
        x = torch.ones(shape, dtype=dtype)
        for _ in range(10):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        result[str(list(shape))] = common.summarize(times)
    # the front's hand-off of a step to the workers: a decode step of 32 requests with 64 KV blocks each
    from mtpserve.executor.step_sync import ScheduledItem, StepMessage, receive_step, send_step
    step = StepMessage([ScheduledItem(str(i), 1000, 1, [7], list(range(64)), [5]) for i in range(32)], [])
    times = []
    for _ in range(iters + 10):
        start = time.perf_counter()
        send_step(None, step) if rank == 0 else receive_step(None)
        times.append(time.perf_counter() - start)
    result["step hand-off (32 requests)"] = common.summarize(times[10:])
    result.update(_time_dispatch(rank, shapes, dtype, iters))
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _timed(fn, iters: int) -> dict:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return common.summarize(times)


def _time_dispatch(rank: int, shapes: list, dtype: torch.dtype, iters: int, experts: int = 8, topk: int = 2) -> dict:
    """One MoE layer's token exchange between 2 expert-parallel ranks, n tokens each routed at random (top-2 of
    8 experts, 4 per rank), two ways: (a) all-gather every token with its routing, reduce-scatter the outputs
    (what the model does); (b) all-to-all: the counts, then only the tokens with a choice on the other rank,
    then their outputs back."""
    import torch.distributed as dist
    result = {}
    for n, hidden in shapes:
        routing = torch.rand(n, experts, generator=torch.Generator().manual_seed(rank)).topk(topk).indices
        owner = routing // (experts // 2)
        packed, gathered = torch.zeros(n, hidden + 2 * topk), torch.empty(2 * n, hidden + 2 * topk)
        partial, mine = torch.zeros(2 * n, hidden, dtype=dtype), torch.empty(n, hidden, dtype=dtype)

        def gather_scatter():
            dist.all_gather_into_tensor(gathered, packed)
            dist.reduce_scatter_tensor(mine, partial)

        to_rank = [(owner == r).any(-1).nonzero().flatten() for r in range(2)]
        send_counts = torch.tensor([len(t) for t in to_rank])

        def all_to_all():
            recv_counts = torch.empty(2, dtype=torch.long)
            dist.all_to_all_single(recv_counts, send_counts)
            sizes_in, sizes_out = recv_counts.tolist(), send_counts.tolist()
            rows = packed[torch.cat(to_rank)]
            received = torch.empty(sum(sizes_in), hidden + 2 * topk)
            dist.all_to_all_single(received, rows, sizes_in, sizes_out)
            outputs = torch.zeros(sum(sizes_in), hidden, dtype=dtype)
            back = torch.empty(sum(sizes_out), hidden, dtype=dtype)
            dist.all_to_all_single(back, outputs, sizes_out, sizes_in)
            torch.zeros(n, hidden, dtype=dtype).index_add_(0, torch.cat(to_rank), back)

        result[f"dispatch all-gather + reduce-scatter [{n}, {hidden}]"] = _timed(gather_scatter, iters)
        result[f"dispatch all-to-all x3 [{n}, {hidden}]"] = _timed(all_to_all, iters)
        result[f"tokens sent to the other rank by all-to-all [{n}]"] = int(send_counts[1 - rank])
    return result


def allreduce_cost(hidden: int, dtype: torch.dtype, batch_sizes: list[int], iters: int = 200) -> dict:
    """ms per all-reduce of [batch, hidden] activations between 2 processes (gloo, loopback), as a TP=2 step
    makes after attention and after the MLP of every layer; the step hand-off; the expert dispatch patterns."""
    from mtpserve.distributed.launch import end_processes, free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    shapes = [(b, hidden) for b in batch_sizes]
    procs = [ctx.Process(target=_time_allreduce, args=(r, port, shapes, dtype, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        end_processes(procs, timeout=30)


def parse_layout(name: str) -> dict:
    """"tp2" -> TP=2; "dp2ep" -> DP=2 with expert parallelism; "tp2ep" -> TP=2 with whole experts per rank."""
    m = re.fullmatch(r"(tp|dp)(\d+)(ep)?", name)
    if not m:
        raise ValueError(f"layout {name!r}: must look like tp1, tp2, tp2ep or dp2ep")
    size = int(m.group(2))
    return dict(layout=name, tensor_parallel_size=size if m.group(1) == "tp" else 1,
                data_parallel_size=size if m.group(1) == "dp" else 1, enable_expert_parallel=bool(m.group(3)))


def run_config(path: str, layout: dict, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
               dtype: str, spec: dict | None, threads: int, quantization: str | None = None) -> dict:
    from mtpserve import LLM, SamplingParams
    ranks = layout["tensor_parallel_size"] * layout["data_parallel_size"]
    if ranks == 1:
        torch.set_num_threads(threads)   # (with more ranks every rank takes cores / ranks threads itself)
    start = time.perf_counter()
    llm = LLM(model=path, dtype=dtype, speculative_config=spec, enforce_eager=True, max_num_seqs=max(batch_sizes),
              seed=0, quantization=quantization, tensor_parallel_size=layout["tensor_parallel_size"],
              data_parallel_size=layout["data_parallel_size"], enable_expert_parallel=layout["enable_expert_parallel"],
              **ENGINE_DEFAULTS)
    startup_s = time.perf_counter() - start
    cfg = llm.engine.model_config
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows, tokens = [], {}
    try:
        for bs in batch_sizes:
            prompts = common.make_prompts(bs, input_len, cfg.vocab_size, llm.get_tokenizer(), seed=bs)
            llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                         use_tqdm=False)   # warm-up
            before = llm.engine.executor.pass_counts()
            tpots, rates = [], []
            for i in range(num_iters):
                t = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
                elapsed = time.perf_counter() - t
                rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                tpots += [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
                          for o in outs]
                if i == 0:
                    tokens[bs] = [o.outputs[0].token_ids for o in outs]
            rows.append(dict(batch_size=bs, tpot_ms=common.summarize(tpots), output_tokens_per_s=common.mean(rates),
                             dummy_step_share=_dummy_share(before, llm.engine.executor.pass_counts())))
        metrics = llm.get_metrics()
        stats = llm.engine.executor.rank_stats
    finally:
        llm.engine.shutdown()
    return dict(layout, threads_per_rank=threads // ranks, startup_s=startup_s, rows=rows,
                ranks=stats, spec=metrics if spec else None), tokens


def _dummy_share(before: list[dict], after: list[dict]) -> float:
    """Of all the target forwards the ranks ran, the share that were dummies (an idle data-parallel rank)."""
    total = sum(a.get("main", 0) - b.get("main", 0) for a, b in zip(after, before))
    dummy = sum(a.get("dummy_main", 0) - b.get("dummy_main", 0) for a, b in zip(after, before))
    return dummy / total if total else 0.0


def run_parallel(path: str, layouts: list[str], batch_sizes: list[int], input_len: int, output_len: int,
                 num_iters: int, dtype: str, spec: dict | None, threads: int, quantization: str | None = None) -> dict:
    configs, tokens = [], {}
    # more ranks first: rank 0's load-time RSS rise is then its own
    for layout in sorted((parse_layout(x) for x in layouts),
                         key=lambda c: -c["tensor_parallel_size"] * c["data_parallel_size"]):
        config, tokens[layout["layout"]] = run_config(path, layout, batch_sizes, input_len, output_len, num_iters,
                                                      dtype, spec, threads, quantization)
        configs.append(config)
    configs.sort(key=lambda c: layouts.index(c["layout"]))
    base = layouts[0]
    for c in configs:
        c["same_tokens_as"] = base
        c["same_tokens"] = tokens[c["layout"]] == tokens[base]
    from mtpserve.config import ModelConfig
    cfg = ModelConfig.from_pretrained(path)
    activations = torch.float32 if dtype in ("auto", "float32", "fp32") else torch.bfloat16
    return dict(configs=configs, quantization=quantization, num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                n_routed_experts=cfg.n_routed_experts, allreduce_ms=allreduce_cost(cfg.hidden_size, activations, batch_sizes))


def print_parallel(res: dict) -> None:
    for c in res["configs"]:
        ranks = c["ranks"]
        print(f"{c.get('layout', 'tp%d' % c['tensor_parallel_size'])} ({c['threads_per_rank']} thread(s)/rank): "
              f"start-up {c['startup_s']:.1f}s, "
              f"weights/rank {ranks[0]['weight_bytes'] / MiB:.0f} MiB, KV/rank {ranks[0]['kv_bytes'] / MiB:.0f} MiB, "
              f"load RSS rise/rank {[round(r['load_peak_rss_rise_bytes'] / MiB) for r in ranks]} MiB")
        for row in c["rows"]:
            print(f"  batch {row['batch_size']}: TPOT {row['tpot_ms']['median']:.2f} ms, "
                  f"{row['output_tokens_per_s']:.1f} tok/s, dummy steps {100 * row.get('dummy_step_share', 0):.0f}%")
    for what, s in res["allreduce_ms"].items():
        print(f"{what}: {s['median']:.3f} ms (median)" if isinstance(s, dict) else f"{what}: {s}")
