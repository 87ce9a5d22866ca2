"""Shared pieces of the benchmarks: metric arithmetic, prompts, the model to run, run records (JSON)."""
import json
import os
import platform
import random
import statistics
import sys
import time

# the random stand-in model when the shipped default model is absent (and no --model is given)
FALLBACK_SIZES = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None,
                      kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                      num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2,
                      max_position_embeddings=2048, num_nextn_predict_layers=2)  # the shipped model's shape


# ---- metric arithmetic (plain numbers in, plain numbers out; tested on synthetic timings) -----------------
def request_metrics(start: float, emissions: list[tuple[float, int]]) -> dict:
    """One request's latencies from its start time and its emissions [(time, tokens so far)], one per engine
    step (or stream chunk) that gave it tokens. TTFT: start -> first emission. ITL: gaps between emissions.
    TPOT excludes the first token: (e2e - ttft) / (n_out - 1)."""
    if not emissions:
        return dict(ttft=None, e2e=None, tpot=None, itls=[], num_tokens=0)
    times = [t for t, _ in emissions]
    n_out = emissions[-1][1]
    ttft, e2e = times[0] - start, times[-1] - start
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    return dict(ttft=ttft, e2e=e2e, tpot=tpot, itls=[b - a for a, b in zip(times, times[1:])], num_tokens=n_out)


def acceptance_stats(num_drafts: int, num_draft_tokens: int, num_accepted: int, per_position: list[int]) -> dict:
    """Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (tokens per
    verification step); per position: the fraction of drafts whose position-i token was accepted."""
    return dict(num_drafts=num_drafts, num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted,
                acceptance_rate=num_accepted / num_draft_tokens if num_draft_tokens else None,
                mean_acceptance_length=1 + num_accepted / num_drafts if num_drafts else 1.0,
                acceptance_per_position=[a / num_drafts for a in per_position] if num_drafts else [])


def summarize(values: list[float], scale: float = 1000.0) -> dict:
    """mean / median / p99 (scaled: seconds -> ms by default)."""
    vals = sorted(v * scale for v in values if v is not None)
    if not vals:
        return dict(mean=None, median=None, p99=None)
    p99 = vals[min(len(vals) - 1, max(0, int(round(0.99 * (len(vals) - 1)))))]
    return dict(mean=statistics.fmean(vals), median=statistics.median(vals), p99=p99)


def mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


# ---- the model and the prompts ----------------------------------------------------------------------------
def resolve_model(model: str | None, scratch_dir: str = "runs/bench") -> tuple[str, str]:
    """-> (path, kind): the given path, else the shipped default model, else a random stand-in checkpoint."""
    from mtpserve import default_model_path
    if model:
        return model, "given"
    if os.path.isfile(os.path.join(default_model_path(), "config.json")):
        return default_model_path(), "default"
    path = os.path.join(scratch_dir, "random_fallback_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from mtpserve.model.checkpoint import write_random_checkpoint
        write_random_checkpoint(path, seed=0, **FALLBACK_SIZES)
    return path, "random (shipped default model not present)"


# the widths `widened_model` scales: hidden 256 -> 1024 at 4x (weights 16x)
WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim",
          "qk_rope_head_dim", "v_head_dim")


def widened_model(factor: int, scratch_dir: str) -> str:
    """A random checkpoint of the shipped model's layout (layers, experts, heads, vocabulary) with every width in
    WIDTHS `factor` times as large, and the shipped tokenizer: the same ops a step, over weights factor^2 times as
    large. Written under scratch_dir once."""
    import shutil

    from mtpserve import default_model_path
    from mtpserve.model.checkpoint import write_random_checkpoint
    path = os.path.join(scratch_dir, f"widened_{factor}x_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(default_model_path(), "config.json")) as f:
            cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type", "torch_dtype")}
        write_random_checkpoint(path, seed=0, **(cfg | {k: cfg[k] * factor for k in WIDTHS}))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(default_model_path(), name), path)
    return path


def model_info(path: str) -> dict:
    """Config highlights and parameter counts read from the checkpoint: per decode step the main model reads
    its layers + norm + lm_head (one embedding row); one MTP pass reads one MTP layer + the shared head."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    from safetensors import safe_open
    layers = cfg["num_hidden_layers"]
    total = main = head = embed = 0
    mtp: dict[int, int] = {}
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, name), "pt") as f:
            for k in f.keys():
                n = _numel(f.get_slice(k).get_shape())
                total += n
                parts = k.split(".")
                if k == "lm_head.weight":
                    head = n
                elif k == "model.embed_tokens.weight":
                    embed = n
                elif len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
                    if not k.endswith(("embed_tokens.weight", "shared_head.head.weight")):
                        mtp[int(parts[2]) - layers] = mtp.get(int(parts[2]) - layers, 0) + n
                else:
                    main += n
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "n_routed_experts",
            "num_experts_per_tok", "kv_lora_rank", "qk_rope_head_dim", "torch_dtype")
    return dict(path=path, num_params_in_checkpoint=total, main_layer_params=main, lm_head_params=head,
                embedding_params=embed, mtp_layer_params=[mtp[d] for d in sorted(mtp)],
                mtp_pass_over_main_step_params=(mtp[0] + head) / (main + head) if mtp and main + head else None,
                **{k: cfg.get(k) for k in keys})


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_prompts(num: int, input_len: int, vocab_size: int, tokenizer=None, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `input_len` token ids: slices of the standard library's held-out files (the
    shipped model never trained on them, train/data.py) when the model has a tokenizer, else random ids."""
    rng = random.Random(seed)
    if tokenizer is not None:
        ids = _heldout_token_stream(tokenizer, rng)
        if len(ids) > input_len:
            room = range(0, len(ids) - input_len)
            starts = sorted(rng.sample(room, num) if num <= len(room) // 4 else rng.choices(room, k=num))
            return [[t % vocab_size for t in ids[s:s + input_len]] for s in starts]
    return [[rng.randrange(2, vocab_size) for _ in range(input_len)] for _ in range(num)]


def _heldout_token_stream(tokenizer, rng: random.Random) -> list[int]:
    from mtpserve.train import data
    root = data.stdlib_root()
    files = data.split_files(data.list_files(root))[1]
    rng.shuffle(files)
    ids: list[int] = []
    for text in data.iter_texts(root, files):
        ids += tokenizer.encode(text)
    return ids


# ---- run records --------------------------------------------------------------------------------------
def run_record(kind: str, args) -> dict:
    import torch
    import transformers
    try:
        from importlib.metadata import version
        mtp_version = version("mtpserve")
    except Exception:
        mtp_version = "unknown"
    return dict(benchmark=kind, command=command_line(kind, args), argv=list(sys.argv),
                started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), commit=git_commit(),
                machine=dict(cpu_count=os.cpu_count(), platform=platform.platform(), processor=platform.processor(),
                             python=platform.python_version(), cuda=torch.cuda.is_available(),
                             torch_threads=torch.get_num_threads()),
                versions=dict(torch=torch.__version__, transformers=transformers.__version__, mtpserve=mtp_version),
                args={k: v for k, v in vars(args).items() if k != "func" and _jsonable(v)})


def git_commit() -> str | None:
    """The checkout's commit (with "+dirty" when it has uncommitted changes), or None outside a git checkout."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def command_line(kind: str, args) -> str:
    """The `mtpserve bench ...` command that ran (rebuilt from the parsed flags when called from Python)."""
    import shlex
    if sys.argv[1:2] == ["bench"]:
        return "mtpserve " + shlex.join(sys.argv[1:])
    flags = []
    for k, v in vars(args).items():
        if k in ("func", "command", "bench_command") or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        flags += [flag] if v is True else [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return "mtpserve bench " + kind + " " + shlex.join(flags)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def write_json(record: dict, path: str | None) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


def peak_rss_bytes() -> int:
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def parse_list(text: str, kind=int) -> list:
    return [kind(x) for x in str(text).split(",") if x.strip()]
