"""Turning logits into the distributions tokens are drawn from, and per-request random draws.

A seeded request draws the randomness for each token position from a generator keyed on its seed and that
position, so its samples depend neither on what else is in the batch nor on how its steps were cut
(speculation, preemption, chunking). Tokens are drawn by the exponential race: argmax(p / E) with
E ~ Exp(1) i.i.d. is a draw from p, and greedy requests (one-hot p) get their argmax for any E.
"""
import torch

from mtpserve.model.ops import opaque_op

MIN_TEMPERATURE = 1e-5


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None, static: bool = False) -> torch.Tensor:
    """logits [M, V]; per-row temperature (0 = greedy), top_k (<= 0 = off), top_p, min_p (0 or None: off) ->
    probs [M, V] (fp32). Each row's distribution depends on its own parameters only. static: no host branch on
    the values (inside a compiled graph: greedy rows picked by a select; the top-k/top-p filter is one opaque op
    in both). min_p acts on the tempered distribution before top-k/top-p, as in vLLM."""
    logits = logits.float()
    greedy = temperature == 0
    if not static and bool(greedy.all()):
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # (a temperature below 1e-5 samples like greedy, and dividing by it could overflow float32 to inf - inf = NaN)
    scaled = logits / torch.where(greedy, 1.0, temperature.clamp(min=MIN_TEMPERATURE)).unsqueeze(-1)
    if min_p is not None and (static or bool((min_p > 0).any())):   # p < min_p * p_max <=> logit < max + log(min_p)
        floor = scaled.max(-1, keepdim=True).values + min_p.clamp_min(1e-30).log().unsqueeze(-1)
        scaled = scaled.masked_fill((scaled < floor) & (min_p > 0).unsqueeze(-1), float("-inf"))
    probs = top_k_top_p(scaled, top_k, top_p).softmax(-1)
    if static or bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


# The top-k / top-p filter looks at each row's best CANDIDATES tokens (a partial top-k, ~20x cheaper than sorting
# a 4096-token vocabulary on the CPU) and sorts a whole row only when its kept set may reach past them. In a graph
# it is one opaque op, so its host branches stay (a graph conditional there would keep inductor from caching the
# graph); under CUDA graphs (no host reads) every row takes both paths.
CANDIDATES = 64


@opaque_op("top_k_top_p(Tensor scaled, Tensor top_k, Tensor top_p) -> Tensor",
           lambda scaled, *_: scaled.new_empty(scaled.shape))
def top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scaled [M, V] with the tokens outside each row's top-k / top-p set at -inf (top_k <= 0 and top_p = 1: off).
    A token is dropped when its rank is top_k or more, or when the mass of the tokens ranked before it (in the
    top-k-restricted distribution) reaches top_p; the first token is always kept."""
    filtered, both_paths = (top_k > 0) | (top_p < 1), scaled.is_cuda   # (CUDA graphs: no host reads)
    if not both_paths and not bool(filtered.any()):
        return scaled.clone()
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    width = min(CANDIDATES, vocab)
    values, order = scaled.topk(width, dim=-1)
    ranks = torch.arange(width, device=scaled.device)
    in_top_k = ranks.unsqueeze(0) < k.unsqueeze(-1)
    # the normaliser: over the top-k candidates when top_k is within them, else over the whole row (top_k off)
    log_total = torch.where(k <= width, values.masked_fill(~in_top_k, float("-inf")).logsumexp(-1),
                            scaled.logsumexp(-1))
    probs = (values - log_total.unsqueeze(-1)).exp().masked_fill(~in_top_k, 0.0)
    before = probs.cumsum(-1) - probs   # mass strictly before each candidate
    keep = in_top_k & (before < top_p.unsqueeze(-1))
    keep[:, 0] = True
    # every token past the candidates is dropped when top_k is within them, or when top_k is off and the
    # candidates' mass reaches top_p (a top_k past them needs its normaliser from the whole sorted row)
    fits = (k <= width) | ((k == vocab) & (probs.sum(-1) >= top_p)) | ~filtered
    kept = torch.full_like(scaled, float("-inf")).scatter(-1, order, values.masked_fill(~keep, float("-inf")))
    kept = torch.where(filtered.unsqueeze(-1), kept, scaled)
    if both_paths:
        return torch.where(fits.unsqueeze(-1), kept, _sorted_top_k_top_p(scaled, filtered, k, top_p))
    if not bool(fits.all()):   # only the rows that need it sorted
        wide = (~fits).nonzero().squeeze(1)
        kept[wide] = _sorted_top_k_top_p(scaled[wide], filtered[wide], k[wide], top_p[wide])
    return kept


def _sorted_top_k_top_p(scaled, filtered, k, top_p):
    """The same filter over whole sorted rows (a row whose kept set may reach past the candidates)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = ranks.unsqueeze(0) >= k.unsqueeze(-1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    cumulative = sorted_probs.cumsum(-1) - sorted_probs
    drop |= cumulative >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    full = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.where(filtered.unsqueeze(-1), full, scaled)


_MASK64 = (1 << 64) - 1
# What a seeded draw is for: one stream per (seed, token position, purpose).
TARGET_NOISE, ACCEPT_UNIFORM = 0, 1


def keyed_seed(seed: int, position: int, purpose: int) -> int:
    """The generator seed of one draw of a seeded request: splitmix64 of (seed, position, purpose), so the draw
    depends on the request's seed and the token position only, not on how the engine cut its steps (CPU
    generators keep the low 32 bits, which the finaliser mixes from all the input bits)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + purpose * 0x8CB92BA72F3D8DD7 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw(seeds: list, positions: list[int], slots: int, width: int, kind: str, purpose: int,
         default: torch.Generator, device, greedy: list[bool] | None = None) -> torch.Tensor:
    """[len(seeds), slots, width] draws ("uniform" in [0,1) or "exponential" Exp(1)). Row i, slot j is for the
    token at position positions[i] + j: a seeded request (seeds[i] not None) draws it from a generator keyed
    on (seed, position, purpose), so the same position always gets the same draw (with or without
    speculation, preemption, batching); unseeded rows draw from the engine's default generator. Greedy rows
    need no randomness (their distributions are one-hot) and get 0 (uniform) or 1 (exponential), drawing
    nothing: U = 0 accepts a draft exactly when it is the target's argmax."""
    out = torch.full((len(seeds), slots, width), 0.0 if kind == "uniform" else 1.0, device=device)
    greedy = greedy or [False] * len(seeds)
    unseeded = [i for i, (s, gr) in enumerate(zip(seeds, greedy)) if s is None and not gr]
    for i, (seed, gr) in enumerate(zip(seeds, greedy)):
        if seed is not None and not gr:
            for j in range(slots):
                gen = torch.Generator(device=device).manual_seed(keyed_seed(seed, positions[i] + j, purpose))
                _fill(out[i, j], kind, gen)
    if unseeded:
        block = torch.empty(len(unseeded), slots, width, device=device)
        _fill(block, kind, default)
        out[unseeded] = block
    return out


def _fill(t: torch.Tensor, kind: str, gen: torch.Generator) -> None:
    if kind == "uniform":
        t.uniform_(0.0, 1.0, generator=gen)
    else:
        t.exponential_(1.0, generator=gen).clamp_min_(1e-30)  # an exact 0 would make p/E undefined


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The one sampling routine (target tokens, drafts, recovered and bonus tokens): the exponential race
    argmax(probs / noise), noise ~ Exp(1) i.i.d., is a draw from probs (normalised or not). probs [..., V] ->
    [...] long; zero-probability entries are never chosen (unless the whole row is zero, which callers avoid)."""
    noise = noise.to(probs.dtype).clamp_min(torch.finfo(probs.dtype).tiny)
    return torch.argmax(probs / noise, dim=-1)


def request_probs(logits: torch.Tensor, reqs, repeats: list[int] | None, device) -> torch.Tensor:
    """The distributions of reqs' rows (request i repeated repeats[i] times) under their sampling parameters
    (the target's, and the MTP head's when drafts are sampled); logits already processed (processors.py)."""
    return logits_to_probs(logits, *sampling_tensors(reqs, repeats, device))


def sampling_tensors(reqs, repeats: list[int] | None = None, device="cpu"):
    """Per-row temperature, top_k, top_p, min_p (request i repeated repeats[i] times)."""
    reps = repeats or [1] * len(reqs)
    rows = [r.params for r, n in zip(reqs, reps) for _ in range(n)]
    return (torch.tensor([float(p.temperature) for p in rows], device=device),
            torch.tensor([int(p.top_k) for p in rows], device=device),
            torch.tensor([float(p.top_p) for p in rows], device=device),
            torch.tensor([float(p.min_p) for p in rows], device=device))
