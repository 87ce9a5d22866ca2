"""`mtpserve bench`: each command runs on a tiny random checkpoint and writes JSON with its fields; the metric
arithmetic (TPOT without the first token, acceptance length, ITL from timestamps) on synthetic timings."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from mtpserve.bench import common, report, serve
from mtpserve.cli import main
from mtpserve.model.checkpoint import write_random_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(str(tmp_path_factory.mktemp("bench") / "tiny"), seed=0)


def run_cli(argv, out):
    main(argv + ["--output-json", str(out)])
    with open(out) as f:
        rec = json.load(f)
    for key in ("command", "machine", "versions", "results"):
        assert key in rec
    assert rec["machine"]["cpu_count"] >= 1 and rec["versions"]["torch"]
    return rec


# ---- metric arithmetic on synthetic timings -----------------------------------------------------------
def test_request_metrics_tpot_excludes_first_token_and_itl_from_timestamps():
    # start at 10.0; first token at 10.5 (TTFT 0.5); then steps emitting 2, 1, 3 tokens
    m = common.request_metrics(10.0, [(10.5, 1), (10.7, 3), (10.8, 4), (11.1, 7)])
    assert m["ttft"] == pytest.approx(0.5) and m["e2e"] == pytest.approx(1.1)
    assert m["tpot"] == pytest.approx((1.1 - 0.5) / 6)        # 6 tokens after the first
    assert m["itls"] == pytest.approx([0.2, 0.1, 0.3])
    assert m["num_tokens"] == 7
    one = common.request_metrics(0.0, [(0.2, 1)])
    assert one["tpot"] is None and one["itls"] == []


def test_acceptance_stats():
    s = common.acceptance_stats(num_drafts=10, num_draft_tokens=20, num_accepted=12, per_position=[8, 4])
    assert s["acceptance_rate"] == pytest.approx(0.6)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 12 / 10)
    assert s["acceptance_per_position"] == pytest.approx([0.8, 0.4])
    assert common.acceptance_stats(0, 0, 0, [])["mean_acceptance_length"] == 1.0


def test_summarize_and_prometheus_parsing():
    s = common.summarize([0.001, 0.002, 0.003])
    assert s["mean"] == pytest.approx(2.0) and s["median"] == pytest.approx(2.0) and s["p99"] == pytest.approx(3.0)
    text = ('# TYPE mtpserve:spec_decode_num_drafts counter\nmtpserve:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            'mtpserve:spec_decode_num_draft_tokens_total{model_name="m"} 20.0\n'
            'mtpserve:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0\n'
            'mtpserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0\n'
            'mtpserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0\n')
    after = serve.parse_metrics(text)
    d = serve.spec_delta({}, after)
    assert d["mean_acceptance_length"] == pytest.approx(2.2) and d["acceptance_per_position"] == [0.8, 0.4]


# ---- the commands -------------------------------------------------------------------------------------
def test_bench_latency(ckpt, tmp_path):
    rec = run_cli(["bench", "latency", "--model", ckpt, "--batch-sizes", "1,2", "--ks", "0,2", "--scorers",
                   "mqa,batch_expansion", "--input-len", "5", "--output-len", "5", "--num-iters", "1",
                   "--plot-dir", str(tmp_path)], tmp_path / "lat.json")
    rows = rec["results"]["configs"]
    assert len(rows) == 2 * 3 and rec["measurement_mode"] == "real"
    for r in rows:
        for key in ("itl_ms", "tpot_ms", "output_tokens_per_s", "acceptance_rate", "mean_acceptance_length",
                    "acceptance_per_position", "tpot_speedup"):
            assert key in r
        assert r["greedy_tokens_equal_no_mtp"] is True   # lossless: same greedy tokens as no MTP
        assert len(r["acceptance_per_position"]) == r["k"]
    assert rec["results"]["kv_cache_bytes_per_token"] > 0
    assert sorted(os.listdir(tmp_path)).count("bench_speedup_vs_k.png") == 1


def test_bench_latency_eager_and_graph_side_by_side(ckpt, tmp_path):
    """--modes eager,graph: one engine per (mode, k), the graph-over-eager ratios, vllm-ascend's graph table. (The
    separate graphs: the fused step's two, greedy and sampled, would double the compile time of a test of the
    bench tool; tests/test_graphs.py tests the fused step.)"""
    from mtpserve.bench import report_tables
    rec = run_cli(["bench", "latency", "--model", ckpt, "--ks", "0,1", "--modes", "eager,graph", "--input-len", "5",
                   "--output-len", "6", "--num-iters", "1", "--speculative-config",
                   '{"method": "mtp", "fused_graph_step": false}'], tmp_path / "modes.json")
    rows = {(r["mode"], r["k"]): r for r in rec["results"]["configs"]}
    assert set(rows) == {("eager", 0), ("eager", 1), ("graph", 0), ("graph", 1)}
    for k in (0, 1):
        graph = rows[("graph", k)]
        assert graph["greedy_tokens_equal_eager"] is True and graph["greedy_tokens_equal_no_mtp"] is True
        assert graph["graph_tpot_speedup_vs_eager"] == pytest.approx(
            rows[("eager", k)]["tpot_ms"]["mean"] / graph["tpot_ms"]["mean"])
    text = "\n".join(report_tables.latency_tables(rec))
    assert "Eager vs graph mode" in text and "MTP k=1 acceleration" in text
    page = tmp_path / "B.md"
    report.write_report([str(tmp_path / "modes.json")], str(page), str(tmp_path / "plots"))
    text = page.read_text()
    assert "## MTP speedup by k and batch size" in text and "| config | eager b1 | graph b1 |" in text
    assert "identical to no MTP in every configuration: **yes**" in text


def test_bench_latency_draft_vocab_axis(ckpt, tmp_path):
    from mtpserve.bench import report_tables
    from mtpserve.config import ModelConfig
    from mtpserve.spec_decode.draft_vocab import write_frequencies
    vocab = ModelConfig.from_pretrained(ckpt).vocab_size
    write_frequencies(ckpt, list(range(vocab)), "test counts")
    rec = run_cli(["bench", "latency", "--model", ckpt, "--ks", "0,1", "--draft-vocab-sizes", "0,16",
                   "--input-len", "5", "--output-len", "5", "--num-iters", "1"], tmp_path / "dv.json")
    rows = rec["results"]["configs"]
    assert [r["name"] for r in rows] == ["no_mtp", "mtp_k1_mqa", "mtp_k1_mqa_dv16"]
    assert [r["draft_vocab_size"] for r in rows] == [None, None, 16]
    assert all(r["greedy_tokens_equal_no_mtp"] for r in rows)
    assert any("| MTP k=1, draft vocab 16 |" in line for line in report_tables.latency_tables(rec))
    from mtpserve.bench import latency
    assert latency.spec_dict(1, "mqa", None, None, 16)["draft_vocab_size"] == 16   # the engines really get it
    assert "draft_vocab_size" not in latency.spec_dict(1, "mqa", None, None, 0)


def test_bench_latency_ngram(ckpt, tmp_path):
    from mtpserve.bench import report_tables
    rec = run_cli(["bench", "latency", "--model", ckpt, "--ks", "0,2", "--speculative-config", '{"method": "ngram"}',
                   "--input-len", "8", "--output-len", "8", "--num-iters", "1"], tmp_path / "ng.json")
    rows = rec["results"]["configs"]
    assert [r["name"] for r in rows] == ["no_mtp", "ngram_k2_mqa"] and rows[1]["method"] == "ngram"
    assert rows[1]["greedy_tokens_equal_no_mtp"] is True
    assert any("| ngram k=2 |" in line for line in report_tables.latency_tables(rec))


def test_bench_latency_synthetic(ckpt, tmp_path):
    rec = run_cli(["bench", "latency", "--model", ckpt, "--ks", "0,2", "--synthetic-acceptance", "1.0",
                   "--input-len", "4", "--output-len", "7", "--num-iters", "1"], tmp_path / "syn.json")
    assert rec["measurement_mode"].startswith("SYNTHETIC")
    k2 = [r for r in rec["results"]["configs"] if r["k"] == 2][0]
    assert k2["acceptance_rate"] == pytest.approx(1.0) and k2["mean_acceptance_length"] == pytest.approx(3.0)


@pytest.mark.parametrize("lockstep", [[], ["--lockstep"]], ids=["whole-runs", "lockstep"])
def test_bench_adaptive(ckpt, tmp_path, lockstep):
    rec = run_cli(["bench", "adaptive", "--model", ckpt, "--max-k", "1", "--batch-sizes", "1,2", "--input-len", "5",
                   "--output-len", "5", "--num-iters", "1", *lockstep], tmp_path / "adaptive.json")
    res = rec["results"]
    assert res["configs"] == ["no_mtp", "mtp_k1", "adaptive_k1"] and len(res["rows"]) == 2
    for row in res["rows"]:
        assert row["outputs_match_no_mtp"] and sum(row["adaptive_k_steps"]) > 0 and row["adaptive_vs_no_mtp"] > 0


def test_bench_sampling(ckpt, tmp_path):
    rec = run_cli(["bench", "sampling", "--model", ckpt, "--k", "1", "--batch-sizes", "1,2", "--input-len", "5",
                   "--output-len", "5", "--num-iters", "1"], tmp_path / "sampling.json")
    rows = rec["results"]["rows"]
    assert {(r["batch_size"], r["fields"], r["engine"]) for r in rows} == {
        (b, f, e) for b in (1, 2) for f in ("none", "logprobs5", "penalties") for e in ("no_mtp", "mtp_k1")}
    # (no tokenizer in this checkpoint: no json_schema set)
    assert all(r["same_tokens_as_no_mtp"] and r["tpot_ms"] > 0 for r in rows)
    page = tmp_path / "page.md"
    report.write_report([str(tmp_path / "sampling.json")], str(page), str(tmp_path / "plots"))
    text = page.read_text()
    assert "## Request features with MTP" in text and "**eager**" in text
    assert "What it says (eager): MTP speedup per request feature" in text and "in every row: yes" in text


def test_bench_overlap(ckpt, tmp_path):
    rec = run_cli(["bench", "overlap", "--model", ckpt, "--modes", "eager", "--ks", "0,1", "--batch-sizes", "1,2",
                   "--input-len", "5", "--output-len", "5", "--num-iters", "1"], tmp_path / "overlap.json")
    rows = rec["results"]["rows"]
    assert [r["name"] for r in rows[:4]] == ["eager_no_mtp_serial", "eager_no_mtp_overlap", "eager_mtp_k1_serial",
                                             "eager_mtp_k1_overlap"] and len(rows) == 8
    assert all(r["same_tokens_as_without_overlap"] and r["tpot_ratio_off_over_on"] > 0 for r in rows)


def test_bench_throughput_and_peers_and_report(ckpt, tmp_path):
    tp = run_cli(["bench", "throughput", "--model", ckpt, "--num-prompts", "6", "--input-len", "5",
                  "--output-len", "5"], tmp_path / "tp.json")
    assert tp["results"]["requests_per_s"] > 0 and tp["results"]["num_output_tokens"] == 30
    pe = run_cli(["bench", "peers", "--model", ckpt, "--num-prompts", "1", "--batch-size", "2", "--input-len", "5",
                  "--output-len", "5", "--k", "1"], tmp_path / "peers.json")
    hf = pe["results"]["transformers"]
    assert hf["hf_generate_batch1"]["tokens_equal_ours"]["requests_identical"] == 1
    assert "tokens_per_s" in hf["hf_generate_use_mtp_batch1"] or "error" in hf["hf_generate_use_mtp_batch1"]
    assert pe["results"]["ours_mtp_tokens_equal_ours_no_mtp"] == {"batch1": True, "batch": True}
    out = tmp_path / "BENCH.md"
    main(["bench", "report", "--results", str(tmp_path / "tp.json"), str(tmp_path / "peers.json"),
          "--out", str(out), "--plot-dir", str(tmp_path)])
    floor = pe["results"]["compute_floor"]
    assert 0 < floor["ours_no_mtp_fraction_of_floor"] < 1 and 0 < floor["hf_fraction_of_floor"] < 1
    assert "transformers generate" in out.read_text() and "Compute floor at batch 2" in out.read_text()


def test_bench_serve(ckpt, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mtpserve.serve.openai_api", "--model", ckpt, "--port",
                               str(port), "--served-model-name", "tiny", "--speculative-config",
                               '{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}',
                               "--max-num-seqs", "4", "--max-model-len", "128", "--num-kv-blocks", "64",
                               "--enforce-eager"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        try:
            import httpx2 as httpx
        except ImportError:
            import httpx
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        rec = run_cli(["bench", "serve", "--port", str(port), "--model", ckpt, "--num-prompts", "4",
                       "--input-len", "5", "--output-len", "6", "--request-rate", "50", "--max-concurrency", "3",
                       "--server-command", "mtpserve serve --enforce-eager"], tmp_path / "serve.json")
    finally:
        server.terminate()
        server.wait(timeout=30)
    r = rec["results"]
    assert r["successful_requests"] == 4 and r["failed_requests"] == 0
    assert r["total_output_tokens"] == 24
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(r[key]) == {"mean", "median", "p99"}
    assert r["spec_decode"]["num_drafts"] > 0
    # the report's serving-against-another-engine table: each server's command, tokens/s over the other engine's
    other = json.loads(json.dumps(rec))
    other["results"].update(server_command="other-server -t 1", output_token_throughput=r["output_token_throughput"] / 2)
    paths = [tmp_path / "serve_peers_mtpserve_c3.json", tmp_path / "serve_peers_other-server_c3.json"]
    for path, record in zip(paths, (rec, other)):
        path.write_text(json.dumps(record))
    page = report.write_report([str(p) for p in paths], str(tmp_path / "BENCH.md"), str(tmp_path / "plots"))
    text = open(page).read()
    assert "## Serving against llama.cpp's server" in text and "- other-server: `other-server -t 1`" in text
    assert f"| mtpserve | 3 | {r['output_token_throughput']:.1f} |" in text and "| 2.00x |" in text


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 24}])
def test_active_weights_per_token_match_the_checkpoint_tensors(tmp_path, overrides):
    # independent count from the stored tensors: every matrix of the main layers, less the routed experts a
    # token does not use (n_routed - top_k of them per MoE layer), and the head
    from conftest import read_safetensors
    from mtpserve.bench import roofline
    from mtpserve.config import ModelConfig
    path = write_random_checkpoint(str(tmp_path / "m"), seed=0, **overrides)
    with open(os.path.join(path, "config.json")) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    assert cfg.n_routed_experts and cfg.first_k_dense_replace < cfg.num_hidden_layers   # both kinds of layer
    tensors = read_safetensors(path)
    layers = 0
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or int(parts[2]) >= cfg.num_hidden_layers or t.dim() != 2:
            continue
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            if int(parts[parts.index("experts") + 1]) >= cfg.num_experts_per_tok:
                continue
        layers += t.numel()
    got = roofline.active_weights_per_token(cfg)
    assert (got["layers"], got["head"]) == (layers, tensors["lm_head.weight"].numel())
    # a k = 1 verify step: two tokens' experts (at most 2 x top_k) in every MoE layer, the MTP layer over the same
    # two positions (its input projection, attention, two tokens' experts), the head twice (target and draft)
    two = 2 * cfg.num_experts_per_tok
    step = 2 * tensors["lm_head.weight"].numel()
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or t.dim() != 2 or parts[3] in ("embed_tokens", "shared_head"):
            continue
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            if int(parts[parts.index("experts") + 1]) >= two:
                continue
        step += t.numel()
    assert roofline.step_weight_params(cfg, 1) == step


def test_compute_floor_counts_every_fed_token():
    from mtpserve.bench import roofline
    from mtpserve.config import ModelConfig
    with open("mtpserve/default_model/config.json") as f:
        cfg = ModelConfig.from_dict(json.load(f))
    w = roofline.active_weights_per_token(cfg)
    f = roofline.compute_floor(cfg, batch=4, input_len=10, output_len=3, gemm_gflops=1.0)
    # 4 x (10 prompt + 2 fed-back) tokens through the layers, 4 x 3 sampled tokens through the head
    assert f["weight_flops"] == 2 * (48 * w["layers"] + 12 * w["head"])
    assert f["floor_seconds"] == pytest.approx(f["weight_flops"] / 1e9)
    assert f["max_output_tokens_per_s"] == pytest.approx(12 / f["floor_seconds"])


def test_roofline_floor_reads_at_the_bandwidth_of_a_buffer_holding_the_step():
    """A step's bytes are read at the speed of the smallest measured buffer holding them, not the cache's best."""
    from mtpserve.bench import roofline
    bw = {"read_gb_per_s_by_mb": {"4": 90.0, "16": 40.0, "64": 28.0}, "read_gb_per_s": 90.0}   # (as in a JSON)
    assert roofline.floor_bandwidth(bw, 3_000_000) == 90.0
    assert roofline.floor_bandwidth(bw, 23_000_000) == 28.0
    assert roofline.floor_bandwidth(bw, 16 << 20) == 40.0
    assert roofline.floor_bandwidth(bw, 500_000_000) == 28.0   # (larger than every buffer: the largest's)


def test_bench_quantization(ckpt, tmp_path):
    """int8 / bf16 / fp32 x no MTP / MTP side by side: every row, perplexities, fp32 MTP equal to no MTP."""
    rec = run_cli(["bench", "quantization", "--model", ckpt, "--batch-sizes", "1", "--input-len", "5",
                   "--output-len", "5", "--num-iters", "1", "--enforce-eager"], tmp_path / "q.json")
    res = rec["results"]
    assert {(r["weights"], r["spec"]) for r in res["rows"]} == {(w, s) for w in ("fp32", "bf16", "int8")
                                                                for s in ("no_mtp", "mtp_k2")}
    assert all(r["lossless"] for r in res["rows"] if r["weights"] == "fp32")
    assert set(res["perplexity"]) == {"fp32", "bf16", "int8"} and all(p > 1 for p in res["perplexity"].values())


def test_bench_roofline(ckpt, tmp_path):
    rec = run_cli(["bench", "roofline", "--model", ckpt, "--ks", "0,1", "--input-len", "4", "--output-len", "6",
                   "--num-iters", "1"], tmp_path / "roof.json")
    rows = rec["results"]["rows"]
    assert [r["k"] for r in rows] == [0, 1] and rows[1]["tokens_per_step"] >= 1
    assert rows[1]["bytes_per_step"]["weight_bytes"] > rows[0]["bytes_per_step"]["weight_bytes"] > 0
    for r in rows:   # (a floor is a floor: no step reads its bytes faster than the bandwidth allows)
        assert 0 < r["fraction_of_roofline"] < 1.5


def test_bench_startup_times_real_servers_and_reports_them(ckpt, tmp_path):
    """`bench startup` starts `mtpserve serve --graph-mode --compile-in-background` from an empty inductor cache
    and again from the one it left, times /health, sends completions for --duration seconds, and the report
    writes its section."""
    from mtpserve.bench import report
    rec = run_cli(["bench", "startup", "--model", ckpt, "--modes", "background", "--duration", "3",
                   "--timeout", "120", "--output-len", "4", "--graph-batch-sizes", "1", "--speculative-config",
                   '{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}'], tmp_path / "startup.json")
    rows = rec["results"]["rows"]
    assert [(r["mode"], r["cache"]) for r in rows] == [("background", "cold"), ("background", "warm")]
    for r in rows:
        assert 0 < r["ready_s"] < 120 and r["timeline"]
        assert all(t >= r["ready_s"] and tps > 0 for t, tps in r["timeline"])
    page = tmp_path / "B.md"
    report.write_report([str(tmp_path / "startup.json")], str(page), str(tmp_path / "plots"))
    text = page.read_text()
    assert "## Graph-mode start-up" in text and "| in the background | cold |" in text
    assert (tmp_path / "plots" / "startup.png").exists()
