"""Turning logits into the distributions tokens are drawn from, and per-request random draws.

Every request draws its randomness from its own generator when it has a seed, so its samples do not
depend on what else is in the batch. Tokens are drawn by the exponential race: argmax(p / E) with
E ~ Exp(1) i.i.d. is a draw from p, and greedy requests (one-hot p) get their argmax for any E.
"""
import torch


MIN_TEMPERATURE = 1e-5


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """logits [M, V]; per-row temperature (0 = greedy), top_k (<= 0 = off), top_p -> probs [M, V] (fp32)."""
    logits = logits.float()
    greedy = temperature == 0
    if bool(greedy.all()):
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # (a temperature below 1e-5 samples like greedy, and dividing by it could overflow float32 to inf - inf = NaN)
    scaled = logits / torch.where(greedy, 1.0, temperature.clamp(min=MIN_TEMPERATURE)).unsqueeze(-1)
    if bool(((top_k > 0) | (top_p < 1)).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)
        drop = ranks.unsqueeze(0) >= k.unsqueeze(-1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        cumulative = sorted_probs.cumsum(-1) - sorted_probs   # mass strictly before each token
        drop |= cumulative >= top_p.unsqueeze(-1)
        drop[:, 0] = False
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


def draw(generators: list, shape: tuple, kind: str, default: torch.Generator, device,
         greedy: list[bool] | None = None) -> torch.Tensor:
    """[len(generators), *shape] draws ("uniform" in [0,1) or "exponential" Exp(1)); row i from generators[i]
    when it is a seeded request's generator, else from the engine's default generator. Greedy rows need no
    randomness (their distributions are one-hot) and get 0 (uniform) or 1 (exponential), drawing nothing:
    U = 0 accepts a draft exactly when it is the target's argmax."""
    out = torch.full((len(generators), *shape), 0.0 if kind == "uniform" else 1.0, device=device)
    greedy = greedy or [False] * len(generators)
    unseeded = [i for i, (g, gr) in enumerate(zip(generators, greedy)) if g is None and not gr]
    for i, (g, gr) in enumerate(zip(generators, greedy)):
        if g is not None and not gr:
            _fill(out[i], kind, g)
    if unseeded:
        block = torch.empty(len(unseeded), *shape, device=device)
        _fill(block, kind, default)
        out[unseeded] = block
    return out


def _fill(t: torch.Tensor, kind: str, gen: torch.Generator) -> None:
    if kind == "uniform":
        t.uniform_(0.0, 1.0, generator=gen)
    else:
        t.exponential_(1.0, generator=gen).clamp_min_(1e-30)  # an exact 0 would make p/E undefined


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (probs / noise).argmax(-1)


def sampling_tensors(reqs, repeats: list[int] | None = None, device="cpu"):
    """Per-row temperature, top_k, top_p (request i repeated repeats[i] times)."""
    reps = repeats or [1] * len(reqs)
    temperature = torch.tensor([float(r.params.temperature) for r, n in zip(reqs, reps) for _ in range(n)])
    top_k = torch.tensor([int(r.params.top_k) for r, n in zip(reqs, reps) for _ in range(n)])
    top_p = torch.tensor([float(r.params.top_p) for r, n in zip(reqs, reps) for _ in range(n)])
    return temperature.to(device), top_k.to(device), top_p.to(device)
