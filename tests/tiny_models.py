"""Checkpoints for the engine tests: random ones, and tiny ones trained for a few seconds on a counting
pattern so that MTP drafts are really accepted (a random MTP layer never agrees with the main model)."""
import torch

from mtpserve.config import ModelConfig
from mtpserve.model.checkpoint import save_checkpoint, tiny_config, write_random_checkpoint
from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from mtpserve.train.loss import mtp_objective

PATTERN_VOCAB = 48


def random_checkpoint(path, **overrides) -> str:
    return write_random_checkpoint(str(path), seed=0, **overrides)


def peaked_checkpoint(path, head_scale: float = 60.0, **overrides) -> str:
    """A random checkpoint with its LM head scaled up: peaked distributions, the draft's unlike the target's
    (near-uniform ones, as random weights give, cannot tell a wrong sampling rule from a right one)."""
    hf = tiny_config(**overrides)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(hf))
    model.init_weights(0)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return save_checkpoint(model, str(path), dtype=torch.float32, hf_config=hf)


def pattern_batch(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Sequences t[i+1] = t[i] + stride (mod vocab), stride in 1..3 per sequence, ids >= 2 (0/1: bos/eos)."""
    start = torch.randint(0, PATTERN_VOCAB - 2, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    return (start + stride * torch.arange(length)) % (PATTERN_VOCAB - 2) + 2


def trained_checkpoint(path, num_mtp_layers: int = 1, steps: int = 80, seed: int = 0) -> str:
    hf = tiny_config(vocab_size=PATTERN_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                     first_k_dense_replace=1, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=1,
                     num_nextn_predict_layers=num_mtp_layers)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(hf))
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = pattern_batch(gen, 16, 24 + num_mtp_layers)
        loss = mtp_objective(model, ids, num_mtp_layers, mtp_lambda=1.0).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_checkpoint(model, str(path), dtype=torch.float32, hf_config=hf)
