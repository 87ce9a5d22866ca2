"""The DeepSeek-V3 training objective: next-token loss plus D sequential MTP losses.

For a window ``ids[:, 0:L+1]`` (L = T + D, so every depth sees at least T positions):
  main     : h = model(ids[:, 0:L])                        predicts ids[:, 1:L+1]
  depth k  : g_k = MTP_k(ids[:, k:L], g_{k-1}[:, :L-k])    predicts ids[:, k+1:L+1]   (g_0 = h)
i.e. depth k at position p combines the embedding of t[p+k] with the previous depth's state at p
and predicts t[p+k+1].  Loss: ``L = L_main + lambda / D * sum_k L_mtp_k``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class StepOutput:
    loss: torch.Tensor                 # the weighted total (differentiable)
    main_loss: float
    mtp_losses: list[float]
    main_correct: int = 0              # top-1 hits (only counted when ``count_correct``)
    main_count: int = 0
    mtp_correct: list[int] = field(default_factory=list)
    mtp_count: list[int] = field(default_factory=list)


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def mtp_objective(model, ids: torch.Tensor, depth: int, mtp_lambda: float,
                  freeze_main: bool = False, count_correct: bool = False) -> StepOutput:
    """ids: LongTensor [B, L+1]. ``depth`` MTP modules are used (<= the model's)."""
    L = ids.shape[1] - 1
    if L - depth < 1:
        raise ValueError(f"window of {ids.shape[1]} tokens is too short for MTP depth {depth}")
    with torch.set_grad_enabled(torch.is_grad_enabled() and not freeze_main):
        h = model.forward_dense(ids[:, :L])
        main_logits = model.compute_logits(h)
    main_target = ids[:, 1:L + 1]
    main_loss = _ce(main_logits, main_target)
    out = StepOutput(loss=main_loss if not freeze_main else main_loss.detach(),
                     main_loss=main_loss.item(), mtp_losses=[])
    if count_correct:
        out.main_correct = int((main_logits.argmax(-1) == main_target).sum())
        out.main_count = main_target.numel()
    prev = h.detach() if freeze_main else h
    mtp_total = 0.0
    for k in range(1, depth + 1):
        g = model.mtp_forward_dense(k - 1, ids[:, k:L], prev[:, :L - k])
        logits = model.mtp_logits(k - 1, g)
        target = ids[:, k + 1:L + 1]
        loss_k = _ce(logits, target)
        mtp_total = mtp_total + loss_k
        out.mtp_losses.append(loss_k.item())
        if count_correct:
            out.mtp_correct.append(int((logits.argmax(-1) == target).sum()))
            out.mtp_count.append(target.numel())
        prev = g
    if depth:
        weighted = mtp_lambda / depth * mtp_total
        out.loss = weighted if freeze_main else out.loss + weighted
    return out


@torch.no_grad()
def evaluate(model, windows: list[torch.Tensor], depth: int, batch_size: int = 8) -> dict:
    """Held-out loss and top-1 accuracy of the main head and of each MTP depth."""
    was_training = model.training
    model.eval()
    sums = {"main_loss": 0.0, "main_correct": 0, "main_count": 0}
    mtp_loss = [0.0] * depth
    mtp_correct = [0] * depth
    mtp_count = [0] * depth
    n_batches = 0
    for i in range(0, len(windows), batch_size):
        ids = torch.stack(windows[i:i + batch_size])
        o = mtp_objective(model, ids, depth, 0.0, count_correct=True)
        w = ids.shape[0]
        sums["main_loss"] += o.main_loss * w
        sums["main_correct"] += o.main_correct
        sums["main_count"] += o.main_count
        for k in range(depth):
            mtp_loss[k] += o.mtp_losses[k] * w
            mtp_correct[k] += o.mtp_correct[k]
            mtp_count[k] += o.mtp_count[k]
        n_batches += w
    model.train(was_training)
    res = {"main_loss": sums["main_loss"] / n_batches,
           "main_acc": sums["main_correct"] / sums["main_count"]}
    for k in range(depth):
        res[f"mtp{k + 1}_loss"] = mtp_loss[k] / n_batches
        res[f"mtp{k + 1}_acc"] = mtp_correct[k] / mtp_count[k]
    return res
