"""Tests of mtpserve.spec_decode.verify against closed forms and the target distribution (statistical tests with fixed
seeds; thresholds: chi-square p-value > 1e-3, means within 5 binomial/sample standard errors)."""
import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from mtpserve.sampling.sampler import sample
from mtpserve.spec_decode.verify import verify_tokens

METHODS = ["token", "block"]


def one_hot(idx, V):
    return torch.nn.functional.one_hot(torch.as_tensor(idx), V).float()


def rand_inputs(B, k, V, gen):
    return torch.rand(B, k, generator=gen), torch.empty(B, k + 1, V).exponential_(1.0, generator=gen)


def draw(probs, gen):
    """One categorical draw per row of probs [N, V] (normalized), by inverting the CDF."""
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=probs.dtype)
    return (u >= torch.cumsum(probs, -1)).sum(-1).clamp_max(probs.shape[-1] - 1)


def chi2_pvalue(observed_idx, expected_probs):
    """Chi-square goodness of fit of integer cell ids against expected probabilities; cells with an expected
    count under 5 are lumped together."""
    n = len(observed_idx)
    exp = np.asarray(expected_probs, dtype=np.float64) * n
    obs = np.bincount(np.asarray(observed_idx), minlength=len(exp)).astype(np.float64)
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
        if exp[-1] == 0:
            assert obs[-1] == 0
            obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()
    return stats.chisquare(obs, exp).pvalue


# ---------------------------------------------------------------------------------------------- greedy, exact

ARGMAX = [2, 4, 1, 3]  # target argmax at slots 0..3 (k = 3, V = 5)
CASES = [  # drafts -> expected output, num accepted
    ([2, 4, 1], [2, 4, 1, 3], 3),
    ([0, 4, 1], [2, -1, -1, -1], 0),
    ([2, 0, 1], [2, 4, -1, -1], 1),
    ([2, 4, 0], [2, 4, 1, -1], 2),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dense_q", [False, True])
def test_greedy_exact(method, dense_q):
    V, k = 5, 3
    gen = torch.Generator().manual_seed(0)
    drafts = torch.tensor([c[0] for c in CASES])
    B = len(CASES)
    target = one_hot(ARGMAX, V).expand(B, k + 1, V).clone()
    q = None
    if dense_q:  # drafts sampled from some q with q(d) > 0
        q = torch.rand(B, k, V, generator=gen) + 0.05
        q = q / q.sum(-1, keepdim=True)
    for _ in range(20):  # any uniforms / noise give the same result
        u, noise = rand_inputs(B, k, V, gen)
        out, n = verify_tokens(drafts, q, target, u, noise, method=method)
        assert out.tolist() == [c[1] for c in CASES]
        assert n.tolist() == [c[2] for c in CASES]
    # uniforms at the edges of [0, 1)
    for uval in (0.0, 1.0 - 1e-7):
        out, n = verify_tokens(drafts, q, target, torch.full((B, k), uval), noise, method=method)
        assert out.tolist() == [c[1] for c in CASES]


@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_and_edge_cases(method):
    V, k, B = 6, 3, 4000
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(B, k + 1, V, generator=gen), -1)
    greedy = torch.arange(B) % 2 == 0
    p[greedy] = one_hot(p[greedy].argmax(-1), V)
    q = torch.softmax(torch.randn(B, k, V, generator=gen), -1)
    q[:8] = p[:8, :k]                          # p == q: no residual mass anywhere
    drafts = draw(q.reshape(-1, V), gen).reshape(B, k)
    drafts[8:12, 0] = 0
    q[8:12, 0, 0] = 0.0                        # q(d) = 0 (impossible draw): must not give NaN
    u, noise = rand_inputs(B, k, V, gen)
    out, n = verify_tokens(drafts, q, p, u, noise, method=method)
    assert ((out >= -1) & (out < V)).all() and ((n >= 0) & (n <= k)).all()
    pos = torch.arange(k + 1)
    assert ((out >= 0) == (pos <= n[:, None])).all()
    assert (out[:, :k][pos[:k] < n[:, None]] == drafts[pos[:k] < n[:, None]]).all()
    # extra token has positive target probability
    extra = out[torch.arange(B), n]
    assert (p[torch.arange(B), n, extra] > 0).all()
    # p == q (sampled rows): everything accepted
    same = torch.arange(8)[~greedy[:8]]
    assert (n[same] == k).all()
    # greedy rows: exactly greedy matching
    am = p.argmax(-1)
    match = torch.cumprod((drafts == am[:, :k]).long(), 1).sum(1)
    g = greedy & (torch.arange(B) >= 12)
    assert (n[g] == match[g]).all()
    assert (extra[g] == am[g, match[g]]).all()


def test_sample():
    gen = torch.Generator().manual_seed(2)
    probs = torch.tensor([0.0, 2.0, 1.0, 0.0, 1.0])  # unnormalized
    N = 100_000
    noise = torch.empty(N, 5).exponential_(1.0, generator=gen)
    x = sample(probs.expand(N, 5), noise)
    assert chi2_pvalue(x.numpy(), (probs / probs.sum()).numpy()) > 1e-3
    assert not ((x == 0) | (x == 3)).any()


# ---------------------------------------------------------------------------------------- k = 1 closed form

@pytest.mark.parametrize("method", METHODS)
def test_k1_acceptance_and_marginal(method):
    V, N = 6, 120_000
    gen = torch.Generator().manual_seed(3)
    p = torch.distributions.Dirichlet(torch.ones(V)).sample()
    q = torch.distributions.Dirichlet(torch.ones(V)).sample()
    p_bonus = torch.distributions.Dirichlet(torch.ones(V)).sample()
    drafts = draw(q.expand(N, V), gen).unsqueeze(1)
    target = torch.stack([p, p_bonus]).expand(N, 2, V)
    u, noise = rand_inputs(N, 1, V, gen)
    out, n = verify_tokens(drafts, q.expand(N, 1, V), target, u, noise, method=method)
    alpha = torch.minimum(p, q).sum().item()
    se = math.sqrt(alpha * (1 - alpha) / N)
    assert abs(n.float().mean().item() - alpha) < 5 * se
    assert chi2_pvalue(out[:, 0].numpy(), p.numpy()) > 1e-3
    # bonus token (when accepted) ~ p_bonus
    assert chi2_pvalue(out[n == 1, 1].numpy(), p_bonus.numpy()) > 1e-3


# ---------------------------------------------------------------- k = 2, 3: joint distribution equals target

def chain(V, gen_seed):
    """Context-dependent toy models: first-token distributions and next-token tables [V, V]."""
    torch.manual_seed(gen_seed)
    d = torch.distributions.Dirichlet(torch.full((V,), 0.8))
    return d.sample(), d.sample((V,)), d.sample(), d.sample((V,))


def run_chain(method, k, V, N, seed, argmax_drafts=False):
    gen = torch.Generator().manual_seed(seed)
    p0, P, q0, Q = chain(V, seed)
    drafts, qs = [], []
    prev = None
    for j in range(k):
        qj = q0.expand(N, V) if j == 0 else Q[prev]
        dj = qj.argmax(-1) if argmax_drafts else draw(qj, gen)
        drafts.append(dj)
        qs.append(qj)
        prev = dj
    drafts = torch.stack(drafts, 1)
    target = torch.stack([p0.expand(N, V)] + [P[drafts[:, j]] for j in range(k)], 1)
    q = None if argmax_drafts else torch.stack(qs, 1)
    u, noise = rand_inputs(N, k, V, gen)
    out, n = verify_tokens(drafts, q, target, u, noise, method=method)
    return out, n, p0, P, gen


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k,V", [(2, 5), (3, 4), (3, 6)])
def test_joint_distribution(method, k, V):
    N, L = 100_000, 3
    out, n, p0, P, gen = run_chain(method, k, V, N, seed=10 * k + V)
    seq = out[:, :L].clone()
    for j in range(1, L):  # complete short outputs with draws from the target (what later steps would do)
        missing = seq[:, j] < 0
        seq[missing, j] = draw(P[seq[missing, j - 1]], gen)
    cell = (seq[:, 0] * V + seq[:, 1]) * V + seq[:, 2]
    expected = (p0[:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)
    assert chi2_pvalue(cell.numpy(), expected.numpy()) > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_joint_distribution_argmax_drafts(method):
    """draft_probs None: drafts are the draft model's argmax (q one-hot); still exact."""
    k, V, N = 2, 5, 100_000
    out, n, p0, P, gen = run_chain(method, k, V, N, seed=7, argmax_drafts=True)
    seq = out[:, :2].clone()
    missing = seq[:, 1] < 0
    seq[missing, 1] = draw(P[seq[missing, 0]], gen)
    expected = (p0[:, None] * P).reshape(-1)
    assert chi2_pvalue((seq[:, 0] * V + seq[:, 1]).numpy(), expected.numpy()) > 1e-3


# -------------------------------------------------------------- block vs token expected accepted length

def expected_lengths(p0, P, q0, Q, k):
    """Closed-form E[num accepted] for token-wise and block verification by enumerating all draft blocks
    (a scalar re-derivation, independent of the vectorised code)."""
    V = len(p0)
    e_tok = e_blk = 0.0
    for xs in itertools.product(range(V), repeat=k):
        ps = [p0] + [P[x] for x in xs]          # target dist at slot j (given drafts before it)
        qs = [q0] + [Q[x] for x in xs[:-1]]
        prob = math.prod(qs[j][xs[j]] for j in range(k))
        # token-wise: sum_i prod_{j<=i} min(1, p/q)
        run, acc = 1.0, 0.0
        for j in range(k):
            run *= min(1.0, ps[j][xs[j]] / qs[j][xs[j]])
            acc += run
        e_tok += prob * acc
        # block: w_i, h_i, P(tau = i) = h_i prod_{j>i} (1 - h_j)
        w, h = 1.0, []
        for i in range(1, k + 1):
            w = min(1.0, w * ps[i - 1][xs[i - 1]] / qs[i - 1][xs[i - 1]])
            if i == k:
                h.append(w)
            else:
                mass = sum(max(w * ps[i][x] - qs[i][x], 0.0) for x in range(V))
                h.append(mass / (mass + 1 - w) if mass + 1 - w > 0 else 1.0)
        e_blk += prob * sum(i * h[i - 1] * math.prod(1 - hj for hj in h[i:]) for i in range(1, k + 1))
    return e_tok, e_blk


def empirical_length(method, p0, P, q0, Q, k, N, seed):
    gen = torch.Generator().manual_seed(seed)
    V = len(p0)
    drafts, qs, prev = [], [], None
    for j in range(k):
        qj = q0.expand(N, V) if j == 0 else Q[prev]
        prev = draw(qj, gen)
        drafts.append(prev)
        qs.append(qj)
    drafts = torch.stack(drafts, 1)
    target = torch.stack([p0.expand(N, V)] + [P[drafts[:, j]] for j in range(k)], 1)
    u, noise = rand_inputs(N, k, V, gen)
    _, n = verify_tokens(drafts, torch.stack(qs, 1), target, u, noise, method=method)
    return n.double()


def test_block_beats_token_paper_example():
    """Sun et al.'s example: V = {a, b}, target (1/3, 2/3), draft (2/3, 1/3), context-free, k = 2:
    token-wise accepts 10/9 tokens on average, block verification 11/9."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    P, Q = p.expand(2, 2), q.expand(2, 2)
    e_tok, e_blk = expected_lengths(p.tolist(), P.tolist(), q.tolist(), Q.tolist(), 2)
    assert e_tok == pytest.approx(10 / 9) and e_blk == pytest.approx(11 / 9)
    N = 100_000
    for method, e in (("token", e_tok), ("block", e_blk)):
        n = empirical_length(method, p.float(), P.float(), q.float(), Q.float(), 2, N, seed=5)
        assert abs(n.mean().item() - e) < 5 * n.std().item() / math.sqrt(N), method


def test_block_beats_token_random_chain():
    k, V, N = 3, 3, 100_000
    p0, P, q0, Q = chain(V, 11)
    e_tok, e_blk = expected_lengths(p0.tolist(), P.tolist(), q0.tolist(), Q.tolist(), k)
    assert e_blk > e_tok + 0.01
    for method, e in (("token", e_tok), ("block", e_blk)):
        n = empirical_length(method, p0, P, q0, Q, k, N, seed=6)
        assert abs(n.mean().item() - e) < 5 * n.std().item() / math.sqrt(N), method
    for seed in range(20, 30):  # optimality: never worse in expectation
        e_tok, e_blk = expected_lengths(*[t.tolist() for t in chain(4, seed)], k=2)
        assert e_blk >= e_tok - 1e-12


def test_extreme_sampling_values_are_refused_or_safe():
    """One hostile request must not break a batch: huge numbers are refused naming the field, and a tiny
    temperature samples (no NaN) like greedy."""
    import math

    from mtpserve import SamplingParams
    from mtpserve.sampling.sampler import logits_to_probs
    for field, value in (("top_k", 9223372036854775808), ("temperature", 10 ** 400), ("top_p", 10 ** 400),
                         ("temperature", math.inf)):
        with pytest.raises(ValueError, match=f"^{field} = "):
            SamplingParams(**{field: value})
    logits = torch.tensor([[3.0, 1.0, -2.0], [0.5, 0.4, 0.1]])
    probs = logits_to_probs(logits, torch.tensor([1e-40, 1.0]), torch.tensor([-1, -1]), torch.tensor([1.0, 1.0]))
    assert not probs.isnan().any()
    assert probs[0].tolist() == [1.0, 0.0, 0.0]


def test_top_k_top_p_from_candidates_equals_sorting_whole_rows():
    """The filter looks at each row's best CANDIDATES tokens and sorts a whole row only when its kept set may
    reach past them: the distributions equal a whole-row sort's, for top-k within and past the candidates, top-p
    sets that fit and that do not, flat and peaked rows, unfiltered and greedy rows in the same batch; and the
    graph form (static: no host branch outside the filter's opaque op) compiles to the same."""
    from mtpserve.sampling.sampler import CANDIDATES, _sorted_top_k_top_p, logits_to_probs
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 4096
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 8, rows).unsqueeze(1)
    temperature = torch.rand(rows, generator=gen) + 0.3
    temperature[7::16] = 0.0
    top_k = torch.tensor([-1, 5, 50, CANDIDATES, CANDIDATES + 1, 1000, vocab, 1] * 8)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99, 0.95, 0.8, 0.3, 0.999] * 8)
    scaled = logits / torch.where(temperature == 0, 1.0, temperature).unsqueeze(-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    want = _sorted_top_k_top_p(scaled, (top_k > 0) | (top_p < 1), k, top_p).softmax(-1)
    greedy = temperature == 0
    want[greedy] = torch.zeros(int(greedy.sum()), vocab).scatter(1, logits[greedy].argmax(-1, keepdim=True), 1.0)
    got = logits_to_probs(logits, temperature, top_k, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want)
    compiled = torch.compile(lambda *a: logits_to_probs(*a, static=True), fullgraph=True)
    graph = compiled(logits, temperature, top_k, top_p)
    assert torch.equal(graph > 0, want > 0)
    torch.testing.assert_close(graph, want)
    fit = [r for r in range(rows) if top_k[r] <= CANDIDATES and temperature[r] > 0]
    graph = compiled(logits[fit], temperature[fit], top_k[fit], top_p[fit])   # no row sorted whole
    torch.testing.assert_close(graph, want[fit])
