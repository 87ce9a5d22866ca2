"""Verification of speculative drafts: token-wise rejection sampling and block verification.

Both keep the output exactly distributed as the target model (greedy targets: exactly greedy). Everything
is vectorised over the batch; the caller draws all randomness (uniforms, Exp(1) noise) from each request's
own generator, so results are reproducible per request and the code has no hidden RNG.

Indexing (0-based): draft slot j in [0, k) holds d_j, drawn from q_j = draft_probs[:, j]; target_probs[:, j]
is p_j, the target distribution of slot j given the prefix and d_0..d_{j-1}; p_k (slot k) is the bonus
distribution after all k drafts.

Token-wise verification (Leviathan et al. 2023, Chen et al. 2023): accept d_j while U_j * q_j(d_j) <
p_j(d_j) (i.e. U_j < p_j(d_j) / q_j(d_j), written without a division); at the first rejection j emit a draw
from normalize(max(p_j - q_j, 0)); if all k pass, emit a draw from p_k.

Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025), in this
file's 0-based indexing with i = number of drafts in the candidate prefix (i = 1..k):
  1. w_0 = 1;  w_i = min(w_{i-1} * p_{i-1}(d_{i-1}) / q_{i-1}(d_{i-1}), 1)   (a clamped running product; it is
     computed without a loop as log w_i = S_i - max(0, S_1..S_i), S_i = sum_{j<i} log ratio_j).
  2. For i < k: the residual mass after the prefix of length i,
        R_i = sum_x max(w_i * p_i(x) - q_i(x), 0),   and   h_i = R_i / (R_i + 1 - w_i);
     for i = k: h_k = w_k.  (0/0, which needs w_i = 1 and p_i <= q_i everywhere, is taken as h_i = 1; in exact
     arithmetic a longer prefix is then always accepted, so the value does not matter.)
  3. With one uniform eta_i per position: tau = the largest i with eta_i < h_i, or 0 if there is none.
     (Unlike token-wise verification, a failure at i does not stop the scan: a later success overrides it.)
  4. Accept d_0..d_{tau-1}. If tau = k, emit a draw from p_k; else emit a draw from the residual
        normalize(max(w_tau * p_tau - q_tau, 0))       (w_0 = 1, so tau = 0 is token-wise's recovery).
Block verification is exact and maximises the expected number of accepted drafts; it is never worse than
token-wise verification. With k = 1 the two coincide.

Coupled verification: the token at every slot is the exponential-race draw argmax(p_j / E_j), and d_j is
accepted while it equals that draw. The emitted tokens are exactly what plain sampling with the same noise
would emit, so the rule is lossless for any drafts; it is used where it loses nothing or where it is needed:
  - argmax drafts (q_j one-hot at d_j) under token-wise verification: P(accept) = p_j(d_j) and, after a
    rejection, the draw is p_j without d_j, renormalised: the law of the rule above, with no uniforms;
  - seeded requests (the caller's `coupled` rows), whose drafts were drawn with the noise their slot gets here
    (d_j = argmax(q_j / E_j)): P(accept) = P(argmax(q/E) = argmax(p/E)), a little below the token-wise
    sum_x min(p, q) when q is not one-hot, bought for reproducibility: a seeded request (noise keyed on its
    positions) emits the same tokens with or without speculation and however its steps were cut.

The other methods end in the same step: emit a draw from normalize(max(w * p_t - q_t, 0)) at slot t, with w = 1,
q_k = 0 for the bonus slot; if that has no positive mass (only possible through rounding or inconsistent
inputs), p_t is used instead.
"""
import torch
from torch import Tensor

from mtpserve.sampling.sampler import sample

_BIG_LOG = 1.0e4  # cap on a log ratio (q(d) = 0): large enough to saturate w at 1 from any w > e^-1e4


def _gather_last(x: Tensor, idx: Tensor) -> Tensor:
    """x[..., idx] along the last dimension, idx of shape x.shape[:-1]."""
    return x.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def _residual_mass(w: Tensor, p: Tensor, q: Tensor | None, d: Tensor) -> Tensor:
    """sum_x max(w * p(x) - q(x), 0) for w [...], p [..., V], q [..., V] or None (one-hot at d [...])."""
    if q is not None:
        return (w.unsqueeze(-1) * p - q).clamp_min(0).sum(-1)
    wp_d = w * _gather_last(p, d)
    return w * p.sum(-1) - wp_d + (wp_d - 1).clamp_min(0)


def _block_tau(p_d: Tensor, q_d: Tensor, target: Tensor, draft_probs: Tensor | None, draft_tokens: Tensor,
               uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification steps 1-3: (tau [B] long, w [B, k] float64 with w[:, i-1] = w_i)."""
    k = p_d.shape[1]
    p64, q64 = p_d.double(), q_d.double()
    # log ratio, safe for zeros: q = 0 -> +cap (w saturates at 1 unless already 0); p = 0 -> -inf (w = 0 for good)
    log_ratio = torch.where(q64 > 0, torch.log(p64) - torch.log(q64.clamp_min(1e-300)),
                            torch.full_like(p64, _BIG_LOG))
    log_ratio = torch.where(p64 > 0, log_ratio.clamp_max(_BIG_LOG), torch.full_like(p64, -float("inf")))
    s = torch.cumsum(log_ratio, dim=1)
    w = torch.exp(s - torch.cummax(s, dim=1).values.clamp_min(0))       # [B, k]: w_1..w_k
    h = w.clone()                                                       # h_k = w_k
    if k > 1:
        wi = w[:, :-1].to(target.dtype)                                 # w_1..w_{k-1}
        q_next = None if draft_probs is None else draft_probs[:, 1:k].to(target.dtype)
        mass = _residual_mass(wi, target[:, 1:k], q_next, draft_tokens[:, 1:k]).double()
        denom = mass + (1 - w[:, :-1])
        h[:, :-1] = torch.where(denom > 0, mass / denom.clamp_min(1e-300), torch.ones_like(mass))
    hits = uniforms.double() < h
    pos = torch.arange(1, k + 1, device=p_d.device)
    tau = (hits.long() * pos).amax(dim=1)
    return tau, w


def coupled_rows(draft_probs: Tensor | None, method: str, seeded: list[bool]) -> list[bool]:
    """Rows verify_tokens verifies by coupling (module docstring): seeded requests', and all rows with argmax
    drafts under token-wise verification. Rows not coupled need uniforms."""
    return [s or (draft_probs is None and method == "token") for s in seeded]


def _coupled(draft_tokens: Tensor, target: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    drawn = sample(target, noise)                                                # [B, k+1]
    k = draft_tokens.shape[1]
    tau = (draft_tokens == drawn[:, :k]).long().cumprod(dim=1).sum(dim=1)
    pos = torch.arange(k + 1, device=target.device)
    return torch.where(pos <= tau.unsqueeze(1), drawn, torch.full_like(drawn, -1)), tau


def verify_tokens(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, uniforms: Tensor | None,
                  noise: Tensor, method: str = "token", coupled: list[bool] | Tensor | bool | None = None
                  ) -> tuple[Tensor, Tensor]:
    """
    draft_tokens: [B, k] long — the drafts d_1..d_k.
    draft_probs:  [B, k, V] float — q_j, the distribution d_j was drawn from; None means the drafts were the
                  draft model's argmax and q_j is one-hot at d_j (vllm-ascend's shortcut; still exact).
    target_probs: [B, k+1, V] float — p_j, the target distribution at each verified position (after
                  temperature/top-k/top-p); greedy requests pass one-hot argmax rows (exactly greedy matching).
    uniforms:     [B, k] in [0, 1) — one U per draft position (None when every row is coupled).
    noise:        [B, k+1, V] Exp(1) noise for the recovered / bonus token draw at each position.
    method:       "token" (token-wise rejection sampling) or "block" (block verification, Sun et al. 2025);
                  see the module docstring for both algorithms.
    coupled:      [B] bools, rows verified by coupling (default: coupled_rows() with no seeded rows); a bool
                  tensor inside a compiled graph (both rules computed, each row's picked); True: every row.
    Returns (output_tokens [B, k+1] long: the accepted drafts, then the one extra token, then -1 padding;
             num_accepted [B] long in [0, k]).
    """
    if method not in ("token", "block"):
        raise ValueError(f"verification method must be 'token' or 'block', got {method!r}")
    B, k = draft_tokens.shape
    if target_probs.shape[:2] != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V] = [{B}, {k + 1}, V], got {list(target_probs.shape)}")
    device = target_probs.device
    target = target_probs if target_probs.dtype in (torch.float32, torch.float64) else target_probs.float()
    draft_tokens = draft_tokens.long()
    rows = torch.arange(B, device=device)

    if coupled is True:
        return _coupled(draft_tokens, target, noise)
    coupled = coupled if coupled is not None else coupled_rows(draft_probs, method, [False] * B)
    per_row = torch.is_tensor(coupled)
    if not per_row and all(coupled):
        return _coupled(draft_tokens, target, noise)
    if k == 0:
        tau = torch.zeros(B, dtype=torch.long, device=device)
        w_tau = torch.ones(B, dtype=target.dtype, device=device)
    else:
        p_d = _gather_last(target[:, :k], draft_tokens)                               # p_j(d_j)  [B, k]
        q_d = (torch.ones_like(p_d) if draft_probs is None
               else _gather_last(draft_probs[:, :k], draft_tokens).to(target.dtype))  # q_j(d_j)
        if method == "token":
            accept = uniforms.to(target.dtype) * q_d < p_d
            tau = torch.cumprod(accept.long(), dim=1).sum(dim=1)
            w_tau = torch.ones(B, dtype=target.dtype, device=device)
        else:
            tau, w = _block_tau(p_d, q_d, target, draft_probs, draft_tokens, uniforms)
            w_full = torch.cat([torch.ones(B, 1, dtype=w.dtype, device=device), w[:, :-1],
                                torch.ones(B, 1, dtype=w.dtype, device=device)], dim=1)   # w_0..w_{k-1}, 1
            w_tau = w_full[rows, tau].to(target.dtype)

    # The extra token: a draw from normalize(max(w * p_tau - q_tau, 0)), q_k = 0 (bonus), falling back to p_tau.
    p_tau = target[rows, tau]                                                      # [B, V]
    has_q = tau < k
    t_q = tau.clamp_max(max(k - 1, 0))
    resid = w_tau.unsqueeze(-1) * p_tau
    if k > 0:
        if draft_probs is None:
            d_tau = draft_tokens[rows, t_q]
            at_d = resid[rows, d_tau]
            resid[rows, d_tau] = torch.where(has_q, (at_d - 1).clamp_min(0), at_d)
        else:
            q_tau = draft_probs[rows, t_q].to(target.dtype)
            resid = resid - q_tau * has_q.unsqueeze(-1).to(target.dtype)
    resid = resid.clamp_min(0)
    ok = (resid.sum(-1) > 0).unsqueeze(-1)
    resid = torch.where(ok, resid, p_tau)
    extra = sample(resid, noise[rows, tau])

    pos = torch.arange(k + 1, device=device)
    drafts_padded = torch.cat([draft_tokens, torch.full((B, 1), -1, dtype=torch.long, device=device)], dim=1)
    out = torch.where(pos < tau.unsqueeze(1), drafts_padded, torch.full_like(drafts_padded, -1))
    out[rows, tau] = extra
    if per_row or any(coupled):
        c_out, c_tau = _coupled(draft_tokens, target, noise)
        mask = coupled if per_row else torch.tensor(coupled, device=device)
        out, tau = torch.where(mask.unsqueeze(1), c_out, out), torch.where(mask, c_tau, tau)
    return out, tau
