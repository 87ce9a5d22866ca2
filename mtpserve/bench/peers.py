"""Peers on the same checkpoint and prompts: transformers' DeepseekV3ForCausalLM.generate, greedy, plain
(batch 1 and batched) and with its MTP candidate generator (generate(use_mtp=True), batch 1 only); llama.cpp
(bench/llamacpp.py)."""
import json
import os
import time

import torch


def load_transformers_model(path: str, dtype: torch.dtype = torch.float32):
    """transformers finds MTP weights through `_keys_to_ignore_on_load_unexpected`, hard-coded to DeepSeek-V3's
    layer 61: point it at this checkpoint's MTP layers (num_hidden_layers .. + D - 1) before loading."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    layers, num_mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    patterns = [rf"model\.layers\.{layers + d}\..*" for d in range(max(num_mtp, 1))]
    DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected = patterns
    DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected = patterns
    return DeepseekV3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _generate(model, prompts: list[list[int]], output_len: int, **kw) -> tuple[list[list[int]], float]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        # eos_token_id=None: never stop early, and do not touch the logits (min_new_tokens would)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **kw)
    elapsed = time.perf_counter() - start
    return out[:, ids.shape[1]:].tolist(), elapsed


def run_peers(path: str, prompts: list[list[int]], output_len: int, batch: int, num_single: int,
              ours_single: list[list[int]] | None, ours_batch: list[list[int]] | None,
              with_mtp: bool = True, log=print, dtype: torch.dtype = torch.float32) -> dict:
    """Runs transformers on `num_single` prompts one at a time (plain and use_mtp) and on the first `batch`
    prompts as one batched generate. Compares greedy tokens with ours."""
    model = load_transformers_model(path, dtype)
    _generate(model, prompts[:1], 4)   # warm-up
    res = {}
    single, t_single = [], 0.0
    for p in prompts[:num_single]:
        toks, t = _generate(model, [p], output_len)
        single.append(toks[0])
        t_single += t
    n_tok = sum(len(t) for t in single)
    res["hf_generate_batch1"] = dict(num_prompts=num_single, output_tokens=n_tok, seconds=t_single,
                                     tokens_per_s=n_tok / t_single,
                                     tokens_equal_ours=_match(single, ours_single))
    log(f"  transformers generate, batch 1: {n_tok / t_single:.1f} tok/s")
    if with_mtp:
        try:
            mtp, t_mtp = [], 0.0
            for p in prompts[:num_single]:
                toks, t = _generate(model, [p], output_len, use_mtp=True)
                mtp.append(toks[0])
                t_mtp += t
            n = sum(len(t) for t in mtp)
            res["hf_generate_use_mtp_batch1"] = dict(
                num_prompts=num_single, output_tokens=n, seconds=t_mtp, tokens_per_s=n / t_mtp,
                tokens_equal_ours=_match(mtp, ours_single), tokens_equal_hf_plain=mtp == single,
                note="transformers' MTPCandidateGenerator drafts one token per MTP layer the checkpoint has "
                     "(k = num_nextn_predict_layers); assisted generation runs at batch 1 only")
            log(f"  transformers generate(use_mtp=True), batch 1: {n / t_mtp:.1f} tok/s")
        except Exception as e:   # report why, keep going
            res["hf_generate_use_mtp_batch1"] = dict(error=f"{type(e).__name__}: {e}")
            log(f"  transformers use_mtp failed: {e}")
    if batch > 1:
        toks, t = _generate(model, prompts[:batch], output_len)
        n = sum(len(x) for x in toks)
        res[f"hf_generate_batch{batch}"] = dict(batch_size=batch, output_tokens=n, seconds=t, tokens_per_s=n / t,
                                                tokens_equal_ours=_match(toks, ours_batch))
        log(f"  transformers generate, batch {batch}: {n / t:.1f} tok/s")
    del model
    return res


def _match(theirs: list[list[int]], ours: list[list[int]] | None) -> dict | None:
    if ours is None:
        return None
    pairs = list(zip(theirs, ours))
    equal = sum(a == b for a, b in pairs)
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
    return dict(requests_identical=equal, requests_compared=len(pairs),
                mean_identical_prefix_tokens=sum(prefix) / len(prefix) if prefix else None)


def from_args(args, path: str) -> dict:
    """`mtpserve bench peers`: the peers named by --peers, one after the other."""
    from mtpserve.bench import common, llamacpp, throughput
    peers = common.parse_list(args.peers, str)
    res = {}
    if "llamacpp" in peers:
        why = llamacpp.missing()
        if why:
            print(f"skipping the llama.cpp peer: {why}")
            res["llamacpp"] = dict(skipped=why)
        else:
            res["llamacpp"] = llamacpp.run_llamacpp(
                path, common.parse_list(args.dtypes, str), common.parse_list(args.ks), args.adaptive,
                common.parse_list(args.batch_sizes), common.parse_list(args.prompt_lens), args.input_len,
                args.output_len, args.num_iters, args.threads or 1, args.enforce_eager, args.draft_vocab_size)
            res["llamacpp"]["widened"] = args.widen
            print("\n".join(llamacpp.table(res["llamacpp"])))
    if "transformers" not in peers:
        return res
    res |= throughput.run_peer_comparison(path, args.k, args.input_len, args.output_len, args.batch_size,
                                         args.num_prompts, args.enforce_eager, with_mtp=not args.no_hf_mtp,
                                         dtype=args.dtype)
    for name, v in res["ratios"].items():
        print(f"  {name}: {v:.2f}x")
    return res
