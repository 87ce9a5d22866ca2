"""Tables of docs/BENCHMARKS.md drawn from one record each (latency sweeps, transformers peers, throughput, serving,
hand-offs); bench/report.py puts them in their sections."""


DEFINITIONS = """Definitions. **ITL**: time between consecutive engine steps that give a request tokens (one verify
step with MTP, which may emit several tokens). **TPOT**: (e2e latency - TTFT) / (output tokens - 1), the first
token excluded. **Acceptance rate**: accepted draft tokens / proposed draft tokens. **Mean acceptance length**:
1 + accepted / drafts (tokens per verify step). **Per position**: fraction of verify steps whose draft i was
accepted. **TPOT speedup**: TPOT(no MTP) / TPOT(config) at the same batch size. All latency runs: greedy
(temperature 0), ignore_eos, fixed output length; prompts are slices of the standard library's held-out files
(neither default model trained on them; bench/common.py) tokenized with the model's tokenizer. **dtype `auto`** in a
Run line: float32 for every run on this page started before 2026-12-06T11:33Z (commit aee89e9); since then the
shipped model's bfloat16 (the CPU's "auto" follows a bf16 checkpoint where mtpserve's bf16 kernels run)."""


def _mode(rec: dict) -> str:
    """How the run's engines ran when it had one mode: its --graph-mode flag."""
    return "graph" if rec.get("args", {}).get("graph_mode") else "eager"


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def latency_tables(rec: dict) -> list[str]:
    rows = rec["results"]["configs"]
    out = [f"Command: `{rec['command']}`", "", f"Model: `{rec.get('model', {}).get('path')}` ({rec.get('model_kind')}) — "
           f"{rec.get('model', {}).get('num_params_in_checkpoint', 0) / 1e6:.1f}M parameters in the checkpoint; "
           f"measurement mode: **{rec.get('measurement_mode', 'real')}**; {rec['results']['configs'][0]['num_iters']} "
           f"iterations per config, interleaved.", ""]
    seed_bs = min(r["batch_size"] for r in rows)
    modes = list(dict.fromkeys(r.get("mode") for r in rows))
    for m in modes:
        mode = m or ("graph mode" if _mode(rec) == "graph" else "eager")
        out += [f"Seed-style table (batch {seed_bs}, {mode}):", "",
                "| config | ITL ms | TPOT ms | acceptance rate | mean acceptance length | TPOT speedup | ITL vs no MTP |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["batch_size"] == seed_bs and r.get("mode") == m and (
                    r["k"] == 0 or r["scorer"] == "mqa" or "mqa" not in {x["scorer"] for x in rows}):
                drafter = "MTP" if r.get("method", "mtp") == "mtp" else r["method"]
                name = "no MTP" if r["k"] == 0 else f"{drafter} k={r['k']}" + (
                    f", draft vocab {r['draft_vocab_size']}" if r.get("draft_vocab_size") else "")
                out.append(f"| {name} | {_f(r['itl_ms']['mean'])} | {_f(r['tpot_ms']['mean'])} | "
                           f"{_f(r['acceptance_rate'], '{:.3f}')} | {_f(r['mean_acceptance_length'])} | "
                           f"{_f(r.get('tpot_speedup'))}x | {_f(r.get('itl_ratio_vs_no_mtp'))}x |")
        out.append("")
    if modes == ["eager", "graph"]:
        out += graph_vs_eager_table(rows, seed_bs)
    out += ["", "Full sweep:", "",
            "| batch | config | ITL ms | TPOT ms | output tok/s | acc. rate | acc. length | per position | "
            "TPOT speedup | greedy = no MTP |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        out.append(f"| {r['batch_size']} | {r['name']} | {_f(r['itl_ms']['mean'])} | {_f(r['tpot_ms']['mean'])} | "
                   f"{_f(r['output_tokens_per_s'], '{:.1f}')} | {_f(r['acceptance_rate'], '{:.3f}')} | "
                   f"{_f(r['mean_acceptance_length'])} | {pos} | {_f(r.get('tpot_speedup'))}x | "
                   f"{_f(r.get('greedy_tokens_equal_no_mtp'), '{}')} |")
    res = rec["results"]
    frac = rec.get("model", {}).get("mtp_pass_over_main_step_params")
    if frac:
        out += ["", f"Cost model: one MTP pass (one MTP layer + the shared output head) has {100 * frac:.0f}% of the "
                    "parameters a main-model decode step has (all layers + head; MoE layers counted whole). In a "
                    "bandwidth- or overhead-bound step that puts a floor of about "
                    f"{1 + frac:.2f}x under ITL(k=1)/ITL(no MTP) and ~{frac:.2f} extra main-step costs per extra k."]
    out += ["", f"KV cache: {res['kv_cache_bytes_per_token']} bytes per token (all layers incl. MTP); peak RSS of "
                f"the run {res['peak_rss_bytes'] / 2**20:.0f} MiB (all engines of the sweep together)."]
    return out


def peers_table(rec: dict) -> list[str]:
    r = rec["results"]
    bs = r["batch_size"]
    out = [f"Command: `{rec['command']}`", "", f"{r['num_single']} prompts one at a time (batch 1) and {bs} at once; "
           f"input {r['input_len']}, output {r['output_len']} tokens, greedy, {r.get('dtype', 'float32')} for "
           f"both{', ours in graph mode' if _mode(rec) == 'graph' else ''}.", "",
           "| system | batch 1 tok/s | batch " + str(bs) + " tok/s | greedy tokens identical to ours (no MTP) |",
           "|---|---|---|---|"]
    for name, v in r["ours"].items():
        out.append(f"| mtpserve {name[5:]} | {v['batch1']['tokens_per_s']:.1f} | {v[f'batch{bs}']['tokens_per_s']:.1f} "
                   f"| {'reference' if name == 'ours_no_mtp' else _yes(r['ours_mtp_tokens_equal_ours_no_mtp'], bs)} |")
    hf = r["transformers"]
    b1 = hf["hf_generate_batch1"]
    bb = hf.get(f"hf_generate_batch{bs}", {})
    out.append(f"| transformers generate | {b1['tokens_per_s']:.1f} | {_f(bb.get('tokens_per_s'), '{:.1f}')} | "
               f"{_match(b1)}; batch {bs}: {_match(bb)} |")
    m = hf.get("hf_generate_use_mtp_batch1", {})
    if "tokens_per_s" in m:
        out.append(f"| transformers generate(use_mtp=True) | {m['tokens_per_s']:.1f} | n/a (batch 1 only) | "
                   f"{_match(m)} |")
    elif m:
        out.append(f"| transformers generate(use_mtp=True) | failed: {m.get('error')} | | |")
    out += ["", "Ratios: " + ", ".join(f"{k} **{v:.2f}x**" for k, v in r["ratios"].items())]
    f = r.get("compute_floor")
    if f:
        out += ["", f"Compute floor at batch {bs} (weight GEMM FLOPs of every prompt and generated token at this "
                f"machine's best fp32 GEMM rate, {f['gemm_gflops']:.0f} GFLOP/s; attention, norms and per-op costs "
                f"left out): {f['floor_seconds']:.2f} s, so at most **{f['max_output_tokens_per_s']:.0f} tok/s**, "
                f"**{f['max_ratio_vs_hf']:.2f}x** transformers' measured batch-{bs} throughput. "
                f"Ours runs at {100 * f['ours_no_mtp_fraction_of_floor']:.0f}% of that floor, transformers at "
                f"{100 * f['hf_fraction_of_floor']:.0f}%."]
    return out


def _yes(eq: dict | None, bs: int) -> str:
    return "-" if not eq else f"batch 1: {'yes' if eq['batch1'] else 'NO'}, batch {bs}: {'yes' if eq['batch'] else 'NO'}"


def _match(d: dict) -> str:
    t = d.get("tokens_equal_ours") if d else None
    return "-" if not t else f"{t['requests_identical']}/{t['requests_compared']}"


def other_table(rec: dict) -> list[str]:
    r = rec["results"]
    out = [f"Command: `{rec['command']}`", ""]
    if rec["benchmark"] == "throughput":
        out.append(f"{r['num_prompts']} prompts: {r['requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:.1f} "
                   f"output tokens/s, {r['total_tokens_per_s']:.1f} total tokens/s; mean acceptance length "
                   f"{r['spec']['mean_acceptance_length']:.2f}; peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB (process), "
                   f"weights {r['weight_bytes'] / 2**20:.1f} MiB, KV cache {r['kv_cache_bytes_per_token']} bytes/token "
                   f"({r['kv_cache_allocated_bytes'] / 2**20:.1f} MiB allocated).")
    elif rec["benchmark"] == "serve":
        sd = r.get("spec_decode") or {}
        out += ["Server: " + ("MTP speculation (drafts counted in its /metrics)" if sd.get("num_drafts")
                              else "no speculation (no drafts counted in its /metrics)"), ""]
        out.append(f"{r['successful_requests']} ok / {r['failed_requests']} failed in {r['duration_s']:.1f}s; "
                   f"{r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} output tok/s.")
        out += ["", "| metric | mean ms | median ms | p99 ms |", "|---|---|---|---|"]
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            out.append(f"| {k[:-3].upper()} | {_f(r[k]['mean'])} | {_f(r[k]['median'])} | {_f(r[k]['p99'])} |")
        sd = r.get("spec_decode")
        if sd and sd["num_drafts"]:
            out += ["", f"Spec decode (from /metrics): acceptance rate {sd['acceptance_rate']:.3f}, mean acceptance "
                        f"length {sd['mean_acceptance_length']:.2f}, per position "
                        f"{[round(x, 3) for x in sd['acceptance_per_position']]}."]
    elif rec["benchmark"] == "handoff":
        out += [f"Decode engine in graph mode, MTP k={r['k']}, {r['batch_size']} requests of {r['input_len']} prompt "
                "tokens handed over at once; importing them (KV copies; scheme 2: the last MTP pass too), then their "
                "first decode step:", "",
                "| hand-off | import median ms | first step median ms | first step p99 ms | graph calls |",
                "|---|---|---|---|---|"]
        for name, s in r["steps"].items():
            out.append(f"| {name} | {_f(s['import_ms']['median'])} | {_f(s['ms']['median'])} | {_f(s['ms']['p99'])} "
                       f"| {s['graph_calls']} |")
    return out


def _yes_no(v) -> str:
    return "—" if v is None else ("yes" if v else "no")


def graph_vs_eager_table(rows: list[dict], bs: int) -> list[str]:
    """The seed's graph-mode table: eager vs graph x (no-MTP ITL, MTP ITL, MTP TPOT, acceleration)."""
    get = {(r["mode"], r["k"]): r for r in rows if r["batch_size"] == bs and (r["k"] == 0 or r["scorer"] == "mqa")
           and not r.get("draft_vocab_size")}
    ks = sorted({k for _, k in get if k})
    out = [f"Eager vs graph mode (batch {bs}; acceleration = eager no-MTP TPOT / this TPOT):", "",
           "| | eager | graph | graph / eager |", "|---|---|---|---|"]
    e0, g0 = get.get(("eager", 0)), get.get(("graph", 0))
    if e0 and g0:
        out.append(f"| no MTP ITL ms | {_f(e0['itl_ms']['mean'])} | {_f(g0['itl_ms']['mean'])} | "
                   f"{_f(g0.get('graph_tpot_speedup_vs_eager'))}x faster |")
    for k in ks:
        e, g = get.get(("eager", k)), get.get(("graph", k))
        if not (e and g and e0):
            continue
        accel_e = e0["tpot_ms"]["mean"] / e["tpot_ms"]["mean"]
        out += [f"| MTP k={k} ITL ms | {_f(e['itl_ms']['mean'])} | {_f(g['itl_ms']['mean'])} | |",
                f"| MTP k={k} TPOT ms | {_f(e['tpot_ms']['mean'])} | {_f(g['tpot_ms']['mean'])} | "
                f"{_f(g.get('graph_tpot_speedup_vs_eager'))}x faster |",
                f"| MTP k={k} acceleration | {accel_e:.2f}x | {_f(g.get('tpot_speedup_vs_eager_no_mtp'))}x | |"]
    builds = [r.get("graph_build_seconds") for r in rows if r.get("mode") == "graph" and r["batch_size"] == bs]
    if any(builds):
        out.append(f"| start-up: compiling the graphs, s | 0 | {min(builds):.1f}-{max(builds):.1f} (per engine) | |")
    return out + [""]


def _serve_peers(recs, plot_dir, page_dir) -> list[str]:
    """serve_peers_<server>_c<N>.json: the same clients against mtpserve serve and another engine's server (each
    launched as its server_command says) -> one row per server, tokens/s against the other engine's."""
    rows = [(name.removeprefix("serve_peers_").rsplit("_c", 1)[0], rec["results"]) for name, rec in recs]
    base = next((res for server, res in rows if not server.startswith("mtpserve")), None)
    out = ["Streaming clients (`mtpserve bench serve`, the same prompts) against each server, one at a time; medians "
           "in ms. Servers:", ""] + [f"- {server}: `{res['server_command']}`" for server, res in rows] + [
        "", "| server | concurrency | output tok/s | TTFT | TPOT | tok/s / the other engine's |", "|---|---|---|---|---|---|"]
    for server, res in rows:
        ratio = f"{res['output_token_throughput'] / base['output_token_throughput']:.2f}x" if base else ""
        out.append(f"| {server} | {res['max_concurrency']} | {res['output_token_throughput']:.1f} | "
                   f"{_f(res['ttft_ms']['median'])} | {_f(res['tpot_ms']['median'])} | {ratio} |")
    return out
