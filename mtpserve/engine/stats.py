"""What the engine reports: speculation and prefix-cache counters (get_metrics) and its load (get_stats), summed
over the data-parallel engine schedulers."""


def metrics(engine) -> dict:
    out = engine.spec_metrics.as_dict()
    queries = sum(c.block_manager.num_queries for c in engine.schedulers)
    hits = sum(c.block_manager.num_hits for c in engine.schedulers)
    out.update(prefix_cache_queries=queries, prefix_cache_hits=hits,
               prefix_cache_hit_rate=hits / queries if queries else 0.0)
    out.update(engine.policy.metrics())
    return out


def load(engine) -> dict:
    schedulers = engine.schedulers
    per_rank = [dict(rank=i, num_running=len(c.running), num_waiting=len(c.waiting), kv_usage=c.block_manager.usage,
                     num_free_blocks=c.block_manager.num_free_blocks, num_total_blocks=c.block_manager.num_blocks)
                for i, c in enumerate(schedulers)]
    out = {key: sum(r[key] for r in per_rank) for key in ("num_running", "num_waiting", "num_free_blocks",
                                                          "num_total_blocks")}
    out["kv_usage"] = 1.0 - out["num_free_blocks"] / out["num_total_blocks"]
    if len(schedulers) > 1:
        out["data_parallel_ranks"] = per_rank
    out["num_held_kv_requests"] = sum(len(c.held) for c in schedulers)
    out["num_preemptions"] = sum(c.num_preemptions for c in schedulers)
    return out
