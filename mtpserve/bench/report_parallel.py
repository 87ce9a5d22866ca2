"""The parallel-layouts section of docs/BENCHMARKS.md (`bench parallel` records): memory and start-up per
rank, TPOT and tokens/s per layout, and what the collectives cost."""
from mtpserve.bench.report_tables import _f, _yes_no


def _layout_name(c: dict) -> str:
    tp, dp = c["tensor_parallel_size"], c.get("data_parallel_size", 1)
    name = f"DP={dp}" if dp > 1 else (f"TP={tp}" if tp > 1 else "1 process")
    return name + ("+EP" if c.get("enable_expert_parallel") else "")


def parallel_table(rec: dict) -> list[str]:
    r = rec["results"]
    mib = 2 ** 20
    configs = r["configs"]
    names = [_layout_name(c) for c in configs]
    experts = f", {r['n_routed_experts']} routed experts" if r.get("n_routed_experts") else ""
    out = [f"Command: `{rec['command']}`", "",
           f"Model: {rec['model']['num_params_in_checkpoint'] / 1e6:.0f}M parameters, {r['num_hidden_layers']} layers, "
           f"hidden {r['hidden_size']}{experts}. The same cores in every row: one process runs on all of them, N ranks "
           "give each rank its share (one thread per rank here).", "",
           f"| layout | start-up s | weights / rank MiB | KV / rank MiB | checkpoint read / rank MiB | load RSS rise / rank MiB "
           f"| same tokens as {names[0]} |", "|---|---|---|---|---|---|---|"]
    for name, c in zip(names, configs):
        ranks = c["ranks"]
        same = c.get("same_tokens", next((v for k, v in c.items() if k.startswith("same_tokens_as_")), None))
        out.append(f"| {name} | {c['startup_s']:.1f} | "
                   + " / ".join(f"{x['weight_bytes'] / mib:.0f}" for x in ranks) + " | "
                   + " / ".join(f"{x['kv_bytes'] / mib:.0f}" for x in ranks) + " | "
                   + " / ".join(f"{x['checkpoint_bytes_read'] / mib:.0f}" for x in ranks) + " | "
                   + " / ".join(f"{x['load_peak_rss_rise_bytes'] / mib:.0f}" for x in ranks) + f" | {_yes_no(same)} |")
    dummies = any("dummy_step_share" in row for c in configs for row in c["rows"])
    out += ["", "| batch | " + " | ".join(f"{n} TPOT ms (median)" for n in names)
            + " | " + " | ".join(f"{n} tok/s" for n in names)
            + (" | " + " | ".join(f"{n} dummy steps" for n in names) if dummies else "") + " |",
            "|---" * (1 + (3 if dummies else 2) * len(configs)) + "|"]
    for i, row in enumerate(configs[0]["rows"]):
        cells = [_f(c["rows"][i]["tpot_ms"]["median"]) for c in configs]
        cells += [_f(c["rows"][i]["output_tokens_per_s"], "{:.1f}") for c in configs]
        if dummies:
            cells += [f"{100 * c['rows'][i].get('dummy_step_share', 0):.0f}%" for c in configs]
        out.append(f"| {row['batch_size']} | " + " | ".join(cells) + " |")
    if any(c.get("spec") for c in configs):
        out += ["", "MTP acceptance: " + ", ".join(
            f"{n} {c['spec']['acceptance_rate']:.3f} (mean acceptance length {c['spec']['mean_acceptance_length']:.2f})"
            for n, c in zip(names, configs) if c.get("spec")) + "."]
    timings = {k: v for k, v in r["allreduce_ms"].items() if isinstance(v, dict)}
    counts = {k: v for k, v in r["allreduce_ms"].items() if not isinstance(v, dict)}
    out += ["", "Between 2 processes (gloo, loopback, one thread each): all-reduces of [batch, hidden] (a TP=2 step "
                "makes two per layer), the front's step hand-off (broadcast_object_list) and one MoE layer's token "
                "exchange under DP+EP two ways (medians): " + ", ".join(f"{what}: {s['median']:.3f} ms"
                                                                      for what, s in timings.items())
            + "".join(f"; {what}: {n}" for what, n in counts.items()) + "."]
    return out
