"""`mtpserve bench parallel`: tensor-parallel sizes side by side on one machine (same cores in all: TP=1 with
all the threads, TP=N with one Nth each), plus the cost of the all-reduce a TP step makes twice per layer."""
import time

import torch
import torch.multiprocessing as mp

from mtpserve.bench import common

MiB = 2 ** 20


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
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def allreduce_cost(hidden: int, dtype: torch.dtype, batch_sizes: list[int], iters: int = 200) -> dict:
    """ms per all-reduce of [batch, hidden] activations between 2 processes (gloo, loopback), as a TP=2 step
    makes after attention and after the MLP of every layer."""
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


def run_config(path: str, tp: int, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
               dtype: str, spec: dict | None, threads: int, quantization: str | None = None) -> dict:
    from mtpserve import LLM, SamplingParams
    if tp == 1:
        torch.set_num_threads(threads)   # (with more ranks every rank takes cores / ranks threads itself)
    start = time.perf_counter()
    llm = LLM(model=path, dtype=dtype, tensor_parallel_size=tp, speculative_config=spec, enforce_eager=True,
              max_num_seqs=max(batch_sizes), seed=0, quantization=quantization)
    startup_s = time.perf_counter() - start
    cfg = llm.engine.model_config
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows, tokens = [], {}
    try:
        for bs in batch_sizes:
            prompts = common.make_prompts(bs, input_len, cfg.vocab_size, llm.get_tokenizer(), seed=bs)
            llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
                         use_tqdm=False)   # warm-up
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
            rows.append(dict(batch_size=bs, tpot_ms=common.summarize(tpots),
                             output_tokens_per_s=common.mean(rates)))
        metrics = llm.get_metrics()
        stats = llm.engine.executor.rank_stats
    finally:
        llm.engine.shutdown()
    return dict(tensor_parallel_size=tp, threads_per_rank=threads // tp, startup_s=startup_s, rows=rows,
                ranks=stats, spec=metrics if spec else None), tokens


def run_parallel(path: str, tps: list[int], batch_sizes: list[int], input_len: int, output_len: int,
                 num_iters: int, dtype: str, spec: dict | None, threads: int, quantization: str | None = None) -> dict:
    configs, tokens = [], {}
    for tp in sorted(tps, reverse=True):   # larger TP first: rank 0's load-time RSS rise is then its own
        config, tokens[tp] = run_config(path, tp, batch_sizes, input_len, output_len, num_iters, dtype, spec,
                                        threads, quantization)
        configs.append(config)
    configs.sort(key=lambda c: c["tensor_parallel_size"])
    base = min(tps)
    for c in configs:
        c["same_tokens_as_tp%d" % base] = tokens[c["tensor_parallel_size"]] == tokens[base]
    from mtpserve.config import ModelConfig
    cfg = ModelConfig.from_pretrained(path)
    activations = torch.float32 if dtype in ("auto", "float32", "fp32") else torch.bfloat16
    return dict(configs=configs, quantization=quantization, num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                allreduce_ms=allreduce_cost(cfg.hidden_size, activations, batch_sizes))


def print_parallel(res: dict) -> None:
    for c in res["configs"]:
        ranks = c["ranks"]
        print(f"TP={c['tensor_parallel_size']} ({c['threads_per_rank']} thread(s)/rank): start-up {c['startup_s']:.1f}s, "
              f"weights/rank {ranks[0]['weight_bytes'] / MiB:.0f} MiB, KV/rank {ranks[0]['kv_bytes'] / MiB:.0f} MiB, "
              f"load RSS rise/rank {[round(r['load_peak_rss_rise_bytes'] / MiB) for r in ranks]} MiB")
        for row in c["rows"]:
            print(f"  batch {row['batch_size']}: TPOT {row['tpot_ms']['median']:.2f} ms, "
                  f"{row['output_tokens_per_s']:.1f} tok/s")
    for shape, s in res["allreduce_ms"].items():
        print(f"all-reduce {shape}: {s['median']:.3f} ms (median)")
