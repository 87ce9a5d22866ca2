"""Converts one of our checkpoints to GGUF with llama.cpp's own converter (run in its own process:
`python -m mtpserve.bench.gguf_convert LLAMA_CPP_DIR CHECKPOINT OUT.gguf OUTTYPE`).

Two facts of our checkpoints that the converter does not know, given to it explicitly:
- the tokenizer's pre-tokenizer (ByteLevel with GPT-2's split) hashes to no model the converter lists, so the
  GGUF is told "gpt-2", llama.cpp's name for that split;
- `q_lora_rank: null` (a plain query projection) is written only when set, and llama.cpp's deepseek2 loader
  reads the key: the converter sees `q_lora_rank: 0`, which the loader reads as "no query LoRA".
The converter drops the MTP layers (layers >= num_hidden_layers) of a DeepseekV3ForCausalLM checkpoint."""
import json
import os
import sys
import tempfile

PRE_TOKENIZER = "gpt-2"


def prepared_checkpoint(checkpoint: str, into: str) -> str:
    """`into`: links to the checkpoint's files and a config.json with q_lora_rank 0 where it is null."""
    for name in os.listdir(checkpoint):
        if name != "config.json":
            os.symlink(os.path.abspath(os.path.join(checkpoint, name)), os.path.join(into, name))
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("q_lora_rank") is None:
        cfg["q_lora_rank"] = 0
    with open(os.path.join(into, "config.json"), "w") as f:
        json.dump(cfg, f)
    return into


def convert(llama_cpp_dir: str, checkpoint: str, out_path: str, outtype: str) -> None:
    sys.path.insert(0, llama_cpp_dir)
    import convert_hf_to_gguf
    from conversion.base import TextModel
    TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["convert_hf_to_gguf.py", prepared_checkpoint(checkpoint, tmp), "--outfile", out_path,
                    "--outtype", outtype]
        convert_hf_to_gguf.main()


if __name__ == "__main__":
    convert(*sys.argv[1:5])
