"""docs/BENCHMARKS.md from one run of scripts/bench_all.sh (`mtpserve bench report --results DIR/*.json`): the
setup, then one section per question, each with the command and the hour it ran, its table, its plot, and a few
lines on what the numbers say, written from the numbers themselves."""
import json
import os

from mtpserve.bench import plots
from mtpserve.bench.report_tables import (DEFINITIONS, _f, _mode, _serve_peers, latency_tables, other_table,  # noqa: F401
                                          peers_table)


def _kind(name: str, rec: dict) -> str:
    """The section a record belongs to: its benchmark, with peers and serving runs told apart by file name."""
    kind = rec.get("benchmark", "")
    if kind == "peers":
        return "peers_llamacpp" if "llamacpp" in rec["results"] else "peers_transformers"
    if kind == "serve" or kind == "handoff":
        if name.startswith(("disagg", "handoff")):
            return "disagg"
        return "serve_peers" if name.startswith("serve_peers") else "serve"
    return kind


SECTIONS = [   # (kind, title, the question it answers)
    ("latency", "MTP speedup by k and batch size, eager and graph mode",
     "How much faster does a request decode with MTP, for each number of drafts k?"),
    ("adaptive", "Adaptive k against fixed k", "Does choosing k per step match the best fixed k?"),
    ("startup", "Graph-mode start-up: graphs compiled at start-up or in the background",
     "How soon does `mtpserve serve --graph-mode` answer, and how fast does it decode in the minutes after?"),
    ("roofline", "Batch-1 decode against the memory-bandwidth floor",
     "How close does a step come to the time it takes to read its bytes?"),
    ("peers_llamacpp", "Against llama.cpp on the same checkpoint",
     "How does mtpserve compare with llama.cpp at the same threads and weight type?"),
    ("peers_transformers", "Against transformers on the same checkpoint",
     "How does mtpserve compare with transformers' generate (plain and with its MTP candidate generator)?"),
    ("quantization", "Weight types: int8, bf16, fp32", "What do int8 weights cost in quality and buy in speed?"),
    ("serve", "Serving by concurrency", "What do clients of `mtpserve serve` see, without and with MTP?"),
    ("serve_peers", "Serving against llama.cpp's server",
     "What do 32 streaming clients get from `mtpserve serve` and from `llama-server` on the same weights?"),
    ("sampling", "Request features with MTP",
     "Does MTP keep its speedup with logprobs, penalties and structured outputs?"),
    ("prefix", "Prefix cache", "What does the prefix cache save on shared prompts?"),
    ("parallel", "Scaling layouts", "One process, TP=2 and DP=2+EP on the same 2 cores"),
    ("disagg", "Prefill/decode disaggregation", "Colocated vs one prefill and one decode server, both hand-offs"),
]


def write_report(paths: list[str], out_path: str, plot_dir: str) -> str:
    recs, run = [], {}
    for p in sorted(paths):
        with open(p) as f:
            data = json.load(f)
        if "benchmark" in data:
            recs.append((os.path.splitext(os.path.basename(p))[0], data))
        else:
            run = data   # run.json: the sitting's wall time
    page_dir = os.path.dirname(os.path.abspath(out_path))
    lines = ["# Benchmarks", ""] + setup(recs, run, paths) + ["", DEFINITIONS, ""]
    lines += ["Sections: " + ", ".join(f"[{title}](#{_anchor(title)})" for kind, title, _ in SECTIONS
                                       if any(_kind(n, r) == kind for n, r in recs)), ""]
    for kind, title, question in SECTIONS:
        mine = sorted(((n, r) for n, r in recs if _kind(n, r) == kind), key=lambda nr: ("eager" in nr[0], nr[0]))
        if not mine:
            continue
        lines += [f"## {title}", "", f"*{question}*", ""]
        lines += globals()[f"_{kind}"](mine, plot_dir, page_dir)
        lines += [""] + [f"Run: `{r['command']}` ({r['started']} to {r.get('finished', '?')}, commit "
                         f"{r.get('commit') or '?'})." for _, r in mine] + [""]
    os.makedirs(page_dir, exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {out_path}")
    return out_path


def setup(recs: list[tuple[str, dict]], run: dict, paths: list[str]) -> list[str]:
    first = recs[0][1]
    m, v = first["machine"], first["versions"]
    commits = sorted({r.get("commit") or "?" for _, r in recs})
    wall = f", {run['wall_seconds'] / 60:.0f} minutes in all" if run.get("wall_seconds") else ""
    model = next((r["model"] for _, r in recs if r.get("model_kind") == "default"), {})
    end = run.get("finished") or max(r.get("finished", r["started"]) for _, r in recs)
    again = sorted(f"`{n}`" for n, r in recs if r["started"] > end)
    return [f"Every figure on this page comes from one run of `scripts/bench_all.sh` "
            f"({run.get('started', first['started'])} to {end}{wall}; commit {', '.join(commits)})"
            + (f", except {', '.join(again)}, run again on its own afterwards (its Run line has the time)"
               if again else "") + ", "
            f"regenerated by `mtpserve bench report --results {os.path.dirname(paths[0]) or '.'}/*.json`. "
            f"Machine: {m['cpu_count']} CPU cores ({m['processor'] or m['platform']}), no GPU, shared with other "
            f"jobs, so absolute figures drift between runs; ratios within one table come from one process with its "
            f"configurations interleaved. torch {v['torch']}, transformers {v['transformers']}. Model: the shipped "
            f"default model ({model.get('num_params_in_checkpoint', 0) / 1e6:.1f}M parameters in the checkpoint, "
            f"{model.get('num_hidden_layers')} layers, {model.get('n_routed_experts')} routed experts, "
            f"{model.get('num_nextn_predict_layers')} MTP layers); prompts are held-out code it never trained on.",
            "", "How these figures came to be (earlier runs, the A/B tests behind the code's choices): "
            "[history.md](history.md)."]


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _rel(path: str, page_dir: str) -> str:
    return os.path.relpath(path, page_dir)


def _latency(recs, plot_dir, page_dir) -> list[str]:
    name, rec = recs[0]
    rows = rec["results"]["configs"]
    cols = sorted({(r.get("mode") or _mode(rec), r["batch_size"]) for r in rows}, key=lambda c: (c[1], c[0]))
    get = {(r.get("mode") or _mode(rec), r["batch_size"], r["k"]): r for r in rows if r["scorer"] in ("mqa", None)
           or r["k"] == 0}
    ks = sorted({r["k"] for r in rows})
    out = ["TPOT in ms (speedup over no MTP at the same batch size and mode); acceptance length = tokens per "
           "verify step.", "", "| config | " + " | ".join(f"{m} b{b}" for m, b in cols) + " | acceptance length |",
           "|" + "---|" * (len(cols) + 2)]
    for k in ks:
        cells = [f"{_f(get[(m, b, k)]['tpot_ms']['mean'])} ({_f(get[(m, b, k)].get('tpot_speedup'))}x)"
                 if (m, b, k) in get else "" for m, b in cols]
        acc = get.get((cols[0][0], cols[0][1], k), {}).get("mean_acceptance_length")
        out.append(f"| {'no MTP' if k == 0 else f'MTP k={k}'} | " + " | ".join(cells) + f" | {_f(acc)} |")
    says = []
    for m, b in cols:
        best = max((get[(m, b, k)] for k in ks if k and (m, b, k) in get), key=lambda r: r["tpot_speedup"])
        says.append(f"{m} batch {b}: best k = {best['k']}, {best['tpot_speedup']:.2f}x")
    lossless = all(r.get("greedy_tokens_equal_no_mtp") is not False for r in rows)
    out += ["", "What it says: " + "; ".join(says) + ". Greedy output identical to no MTP in every configuration: "
            + ("**yes**" if lossless else "**NO**") + "."]
    out += ["", "<details><summary>Full sweep (ITL, per-position acceptance, graph vs eager)</summary>", ""]
    out += latency_tables(rec) + ["", "</details>", ""]
    out += [f"![{os.path.basename(p)}]({_rel(p, page_dir)})" for p in plots.plot_latency(rec, plot_dir, "latency_")]
    return out


def _adaptive(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import adaptive
    res = recs[0][1]["results"]
    out = ["Output tokens/s per engine, the same prompts, interleaved.", ""] + adaptive.table(res)
    vs_best = [r["adaptive_vs_best_fixed"] for r in res["rows"]]
    vs_none = [r["adaptive_vs_no_mtp"] for r in res["rows"]]
    return out + ["", f"What it says: adaptive k runs at {min(vs_best):.2f}-{max(vs_best):.2f}x the best fixed k "
                      f"of each batch size and {min(vs_none):.2f}-{max(vs_none):.2f}x no speculation."]


def _startup(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import startup
    out = []
    for name, rec in recs:   # (one table per run)
        res = rec["results"]
        lines = {f"{r['mode']}, {r['cache']}": r["timeline"] for r in res["rows"]}
        plot = plots.plot_lines(lines, "seconds since the server started", "batch-1 output tokens/s",
                                "Decode speed after start-up", plot_dir, f"{name}.png")
        says = "; ".join(f"{r['mode']} {r['cache']}: " + (
            f"ready after {r['ready_s']} s, {startup.whole_run_rate(r, res['output_len']):.0f} tok/s from then on"
            if r["ready_s"] else f"not ready after {res['timeout_s']:.0f} s") for r in res["rows"])
        rows = {(r["mode"], r["cache"]): r for r in res["rows"]}
        cold = [rows.get((m, "cold"), {}).get("ready_s") for m in ("background", "startup")]
        if all(cold):
            says += f"; from a cold cache the server answers {cold[1] / cold[0]:.0f}x sooner compiling in the background"
        out += [f"**Speculative config {res['speculative_config']}**, graph batch sizes {res['graph_batch_sizes']}, "
                f"commit {rec.get('commit', '?')}:",
                ""] + startup.table(res) + ["", f"What it says: {says}.", "", f"![{name}]({_rel(plot, page_dir)})", ""]
    return out[:-1]


def _roofline(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import roofline
    out = []
    for _, rec in recs:
        out += roofline.table(rec["results"]) + [""]
    return out + ["Bytes: the weights a step multiplies (bench/roofline.py, step_weight_params: routed experts "
                  "counted at most, the MTP passes with the head each) and the KV it reads; the floor: those bytes at "
                  "the bandwidth of the smallest buffer holding them (floor_bandwidth; before 2026-12-07 the best)."]


def _peers_llamacpp(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import llamacpp
    out = []
    for name, rec in recs:
        res = rec["results"]["llamacpp"]
        if "skipped" in res:
            out += [f"Skipped: {res['skipped']}.", ""]
            continue
        mode = "eager" if rec["args"].get("enforce_eager") else "graph mode"
        out += [f"**{res['threads']} thread{'s' if res['threads'] > 1 else ''}, mtpserve in {mode}** (ratios: ours / "
                f"llama.cpp{llamacpp.notes(res)}):", ""] + llamacpp.table(res) + [""]
        b = res["batch_sizes"][0]
        groups = {f"{r['dtype']} / {r['gguf_type']}": {"llama.cpp": llamacpp.their_decode(r["llamacpp"], b, res)}
                  | {f"mtpserve {e}": o[str(b)]["tokens_per_s"] for e, o in r["ours"].items()} for r in res["rows"]}
        plot = plots.plot_bars(groups, "decode tokens/s", f"Batch {b} decode, {res['threads']} thread(s)",
                               plot_dir, f"{name}.png")
        out += [f"![{name}]({_rel(plot, page_dir)})", ""]
        out += ["What it says: " + llamacpp.summary(res), ""]
    return out + ["llama.cpp: the version llama-cpp-python 0.3.36 vendors, built by scripts/build_llamacpp.sh for this "
                  "CPU; the checkpoint converted by its own converter (bench/gguf_convert.py says what is mapped); "
                  "`llama-bench` for prompts and batch-1 decode, `llama-batched-bench` for batched decode (one "
                  "32-token prompt per sequence). Ours: decode tokens/s = batch / TPOT, prompt tokens/s from "
                  "one-token requests; llama.cpp's figures are the mean of a run before and a run after ours."]


def _peers_transformers(recs, plot_dir, page_dir) -> list[str]:
    return peers_table(recs[0][1])


def _quantization(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import quantization
    res = recs[0][1]["results"]
    ppl = res["perplexity"]
    differ = ", ".join(f"{r['weights']} batch {r['batch_size']}" for r in res["rows"] if not r["lossless"])
    lossless = (f"MTP's greedy output differs from no MTP's for {differ} (a product that gives a row other bits among "
                "a verify step's rows than alone: README, 'What works')" if differ else "MTP's greedy output: no MTP's")
    return quantization.table(res) + ["", f"What it says: int8 perplexity {ppl['int8'] / ppl['bf16']:.4f}x bf16's "
                                          f"on held-out code; {lossless} (column 'MTP = no MTP')."]


def _serve(recs, plot_dir, page_dir) -> list[str]:
    by = {}
    for name, rec in recs:
        spec, conc = name.removeprefix("serve_").rsplit("_c", 1)
        by.setdefault(int(conc), {})[spec] = rec["results"]
    specs = sorted({s for v in by.values() for s in v}, key=lambda s: (s != "none", s))   # (none first)
    out = ["Streaming clients against `mtpserve serve --max-num-seqs 32 --enforce-eager` (one model thread), without "
           "speculation (none) and with `--speculative-config` MTP k = 2 (scripts/bench_all.sh); medians in ms.", "",
           "| concurrency | " + " | ".join(f"{s} tok/s | {s} TTFT | {s} TPOT" for s in specs) + " |",
           "|" + "---|" * (1 + 3 * len(specs))]
    for c in sorted(by):
        cells = [f"{by[c][s]['output_token_throughput']:.1f} | {_f(by[c][s]['ttft_ms']['median'])} | "
                 f"{_f(by[c][s]['tpot_ms']['median'])}" if s in by[c] else " | | " for s in specs]
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    if len(specs) == 2:
        a, b = specs
        ratios = [by[c][b]["output_token_throughput"] / by[c][a]["output_token_throughput"] for c in sorted(by)
                  if a in by[c] and b in by[c]]
        out += ["", f"What it says: {b} / {a} output tokens/s = " + ", ".join(f"{x:.2f}x" for x in ratios)
                + f" at concurrency {', '.join(map(str, sorted(by)))}."]
    out += ["", f"![serve]({_rel(plots.plot_serve(by, plot_dir), page_dir)})"]
    return out


def _sampling(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import sampling
    out = []
    for _, rec in recs:   # (eager first, then graph mode)
        rows = rec["results"]["rows"]
        same = all(r["same_tokens_as_no_mtp"] for r in rows)
        mode = "graph mode" if rec["results"].get("enforce_eager") is False else "eager"
        out += [f"**{mode}**", ""] + sampling.table(rec["results"]) + [
            "", f"What it says ({mode}): MTP speedup per request feature {min(r['mtp_speedup'] for r in rows):.2f}-"
                f"{max(r['mtp_speedup'] for r in rows):.2f}x; the same tokens with and without MTP in every row: "
                f"{'yes' if same else 'NO'}.", ""]
    return out[:-1]


def _prefix(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench import prefix
    return prefix.table(recs[0][1]["results"])


def _parallel(recs, plot_dir, page_dir) -> list[str]:
    from mtpserve.bench.report_parallel import _layout_name, parallel_table
    out = []
    for name, rec in recs:
        configs = rec["results"]["configs"]
        groups = {f"batch {row['batch_size']}": {_layout_name(c): c["rows"][i]["tpot_ms"]["median"] for c in configs}
                  for i, row in enumerate(configs[0]["rows"])}
        plot = plots.plot_bars(groups, "TPOT median (ms)", "Layouts on the same 2 cores", plot_dir, f"{name}.png")
        first = _layout_name(configs[0])
        says = "; ".join(f"{g}: " + ", ".join(f"{lay} {t / by[first]:.2f}x" for lay, t in by.items() if lay != first)
                         for g, by in groups.items())
        out += parallel_table(rec) + ["", f"What it says: TPOT against {first}: {says}. On 2 cores the ranks' "
                                      "collectives cost more than splitting the work saves.", "",
                                      f"![{name}]({_rel(plot, page_dir)})", ""]
    return out


def _disagg(recs, plot_dir, page_dir) -> list[str]:
    out = ["| setup | output tok/s | TTFT median ms | TPOT median ms | acceptance length |", "|---|---|---|---|---|"]
    for name, rec in recs:
        r = rec["results"]
        if rec["benchmark"] == "serve":
            acc = (r.get("spec_decode") or {}).get("mean_acceptance_length")
            out.append(f"| {name.removeprefix('disagg_')} | {r['output_token_throughput']:.1f} | "
                       f"{_f(r['ttft_ms']['median'])} | {_f(r['tpot_ms']['median'])} | {_f(acc)} |")
    serving = {n.removeprefix("disagg_"): r["results"] for n, r in recs if r["benchmark"] == "serve"}
    groups = {metric: {n: r[f"{metric.lower()}_ms"]["median"] for n, r in serving.items()}
              for metric in ("TTFT", "TPOT")}
    plot = plots.plot_bars(groups, "median (ms, log scale)", "Colocated vs one prefill + one decode server",
                           plot_dir, "disagg.png", log=True)
    base = serving.get("colocated_2cores")
    if base:
        out += ["", "What it says: against one colocated server on both cores, " + "; ".join(
            f"{n}: TTFT {r['ttft_ms']['median'] / base['ttft_ms']['median']:.2f}x, TPOT "
            f"{r['tpot_ms']['median'] / base['tpot_ms']['median']:.2f}x" for n, r in serving.items() if r is not base)
            + " (the prefill server has one core where the colocated one has two; the decode server's steps carry "
              "no prompts)."]
    out += ["", f"![disagg]({_rel(plot, page_dir)})"]
    for name, rec in recs:
        if rec["benchmark"] == "handoff":
            out += ["", f"**{name}**:", ""] + other_table(rec)[2:]
    return out
