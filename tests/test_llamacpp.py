"""The llama.cpp peer's glue: converting our checkpoint with llama.cpp's own converter (skipped where that converter
is not on this machine: scripts/build_llamacpp.sh puts it there), and the benchmark's message where the peer is
not built."""
import os
import shutil
import subprocess
import sys

import pytest

from mtpserve import default_model_path
from mtpserve.bench import llamacpp

CONVERTER = os.path.join(llamacpp.llamacpp_dir(), "convert_hf_to_gguf.py")


@pytest.mark.skipif(not os.path.isfile(CONVERTER), reason=f"llama.cpp's converter is not at {CONVERTER} "
                                                          "(scripts/build_llamacpp.sh fetches it)")
def test_tiny_checkpoint_converts_to_a_gguf_llamacpp_can_load(tmp_path):
    from mtpserve.model.checkpoint import write_random_checkpoint
    ckpt = str(tmp_path / "ckpt")
    write_random_checkpoint(ckpt, seed=0, vocab_size=4096, num_hidden_layers=3, num_nextn_predict_layers=1,
                            q_lora_rank=None, first_k_dense_replace=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path(), name), ckpt)
    out = str(tmp_path / "tiny-f32.gguf")
    subprocess.run([sys.executable, "-m", "mtpserve.bench.gguf_convert", llamacpp.llamacpp_dir(), ckpt, out, "f32"],
                   check=True, capture_output=True)
    sys.path.insert(0, os.path.join(llamacpp.llamacpp_dir(), "gguf-py"))
    import gguf
    reader = gguf.GGUFReader(out)
    field = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.")
             or f.name == "tokenizer.ggml.pre"}
    assert field["general.architecture"] == "deepseek2"
    assert field["tokenizer.ggml.pre"] == "gpt-2"              # our ByteLevel/GPT-2 split, named explicitly
    assert field["deepseek2.attention.q_lora_rank"] == 0       # a plain query projection
    assert field["deepseek2.block_count"] == 3                 # the MTP layer is dropped
    assert not [t.name for t in reader.tensors if t.name.startswith("blk.3.")]
    if llamacpp.tool("llama-bench"):                          # llama.cpp itself loads and runs it
        speeds = llamacpp.llama_bench(out, threads=1, prompt_lens=[16], gen_len=4, reps=1)
        assert speeds["pp16"] > 0 and speeds["tg4"] > 0


def test_peer_not_built_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPSERVE_LLAMACPP_DIR", str(tmp_path))
    why = llamacpp.missing()
    assert "scripts/build_llamacpp.sh" in why and str(tmp_path) in why


def test_table_and_summary_ratios_are_ours_over_theirs():
    res = dict(threads=1, output_len=128, batch_sizes=[1, 8], prompt_lens=[512], our_prompt_lens=[512], rows=[dict(
        dtype="int8", gguf_type="q8_0", llamacpp={"pp512": 1000.0, "tg128": 400.0, "batch8": 800.0},
        ours_prompt={"pp512": 1500.0},
        ours={"no_mtp": {"1": dict(tokens_per_s=200.0), "8": dict(tokens_per_s=400.0)},
              "mtp_k2": {"1": dict(tokens_per_s=300.0), "8": dict(tokens_per_s=1200.0)}})])
    text = "\n".join(llamacpp.table(res))
    assert "| mtpserve int8 no_mtp | 1500 (1.50x) | 200.0 (0.50x) | 400.0 (0.50x) |" in text
    assert "| llama.cpp q8_0 | 1000 | 400.0 | 800.0 |" in text
    said = llamacpp.summary(res)
    assert "batch 1 decode, ours / llama.cpp: 0.50x without speculation, 0.75x with" in said
    assert "batch 8 decode, ours / llama.cpp: 0.50x without speculation, 1.50x with" in said
    assert "512-token prompts 1.50x" in said


def test_a_llamacpp_run_that_aborts_is_measured_again_without_repacking(monkeypatch):
    """llama.cpp's tools die on an assertion where their weight repacking fails (Q8_0 on an AMX CPU): the run is
    measured again with repacking off, both tools, and the result says so."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if "--repack" in cmd and cmd[cmd.index("--repack") + 1] == "1":
            raise subprocess.CalledProcessError(-6, cmd)
        if "llama-bench" in cmd[0]:
            return subprocess.CompletedProcess(cmd, 0, stdout='[{"n_prompt": 16, "n_gen": 0, "avg_ts": 90.0}, '
                                                              '{"n_prompt": 0, "n_gen": 4, "avg_ts": 30.0}]', stderr="")
        return subprocess.CompletedProcess(cmd, 0, stdout='{"n_kv_max": 1, "pl": 8, "speed_tg": 120.0}\n', stderr="")

    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    monkeypatch.setattr(llamacpp, "tool", lambda name: f"/bin/{name}")
    got = llamacpp._theirs("m.gguf", 1, [16], 4, [1, 8], 1, log=lambda *a: None)
    assert got == {"pp16": 90.0, "tg4": 30.0, "batch8": 120.0, "repacked": 0.0}
    assert len(calls) == 3 and "--no-repack" in calls[2]


def test_a_peer_run_without_k_0_is_refused_before_anything_is_built():
    """Our prompt speed is the engine's without speculation: --ks without 0 is refused at once (it used to fail
    with a KeyError after the engines were built and timed)."""
    with pytest.raises(SystemExit, match="--ks 2: must include 0"):
        llamacpp.run_llamacpp("no-such-model", ["int8"], [2], True, [1], [512], 32, 128, 2, 1, None)
