"""The engine's batched sampler: greedy, filters (top-k, top-p, min-p) against a plain reference,
draws distributed as softmax(logits / T), and samples that depend on (seed, index, position) only."""
import math

import numpy as np
import pytest
import torch

from paged_backend.integration.sampler import SampleMode, SampleRows, Sampler, row_keys
from paged_backend.gumbel import mix32


def rows(s, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, keys=None, num_logprobs=0):
    full = lambda v, dt: np.full(s, v, dt) if np.isscalar(v) else np.asarray(v, dt)  # noqa: E731
    return SampleRows(full(temperature, np.float32), full(top_k, np.int64), full(top_p, np.float32),
                      full(min_p, np.float32), row_keys(np.arange(s), np.zeros(s), np.zeros(s)) if keys is None
                      else keys, num_logprobs)


def exact_probs(logits, t, k, p, mp):
    """[V] float64: the probability of each token under the documented rule (vLLM v1's), by plain
    Python on the sampler's fp32 ``logits / t``: min-p, then top-k (ties with the k-th stay), then
    top-p over what is left (a token stays while the mass strictly more likely than it is < p)."""
    x = (logits.float() / t).double().tolist()
    m = max(x)
    keep = [i for i, a in enumerate(x) if math.exp(a - m) >= mp]  # p_i >= min_p * p_max
    if 0 < k < len(keep):
        kth = sorted((x[i] for i in keep), reverse=True)[k - 1]
        keep = [i for i in keep if x[i] >= kth]
    if p < 1.0:
        zk = sum(math.exp(x[i] - m) for i in keep)
        keep = [i for i in keep if sum(math.exp(x[j] - m) for j in keep if x[j] > x[i]) / zk < p]
    probs = torch.zeros(len(x), dtype=torch.float64)
    zk = sum(math.exp(x[i] - m) for i in keep)
    for i in keep:
        probs[i] = math.exp(x[i] - m) / zk
    return probs


def allowed_reference(logits, t, k, p, mp):
    """The set of token ids a row may draw."""
    return set(torch.nonzero(exact_probs(logits, t, k, p, mp)).flatten().tolist())


def chi_square_pvalue(counts, probs):
    """Pearson's test of draw counts [V] against exact probabilities [V]; bins expecting < 5 draws
    are pooled. A draw of a token of probability 0 gives p-value 0."""
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    exp = probs * n
    small = (exp < 5) & (probs > 0)
    obs = torch.cat([counts[exp >= 5], counts[small].sum()[None]]).double()
    exp = torch.cat([exp[exp >= 5], exp[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    dof = obs.numel() - 1
    if dof == 0:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def test_hash_is_the_same_on_numpy_and_torch_and_looks_uniform():
    x = np.arange(0, 2 ** 32, 2 ** 32 // 4099, dtype=np.uint64).astype(np.uint32)
    a = mix32(x)
    b = mix32(torch.from_numpy(x.astype(np.int64))).numpy().astype(np.uint32)
    assert np.array_equal(a, b)
    sampler = Sampler(50_000, "cpu")
    h = mix32(torch.tensor([12345])[:, None] ^ sampler._vocab_hash[None, :])[0]
    u = ((h >> 9).double() + 0.5) / (1 << 23)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    counts = torch.bincount((u * 10).long(), minlength=10).double()
    assert (counts / counts.mean() - 1).abs().max() < 0.05


def test_row_keys_differ_per_seed_index_and_position():
    keys = row_keys(np.array([0, 1, 0, 0, 2 ** 40]), np.array([0, 0, 1, 0, 0]), np.array([0, 0, 0, 1, 0]))
    assert len(set(keys.tolist())) == 5
    assert np.array_equal(row_keys([7], [3], [9]), row_keys([7], [3], [9]))


def test_greedy_is_argmax_and_logprobs_are_raw():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    out = Sampler(300, "cpu")(logits, rows(5, temperature=0.0, num_logprobs=3))
    assert torch.equal(out.tokens, logits.argmax(-1))
    lsm = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, lsm.max(-1).values, atol=1e-6)
    assert torch.equal(out.top_ids[:, 0], out.tokens) and torch.allclose(out.top_logprobs, lsm.topk(3).values, atol=1e-6)


@pytest.mark.parametrize("k,p,mp", [(5, 1.0, 0.0), (-1, 0.5, 0.0), (-1, 1.0, 0.2), (20, 0.8, 0.05), (1, 1.0, 0.0)])
def test_filters_keep_exactly_the_reference_set(k, p, mp):
    torch.manual_seed(1)
    v, draws = 64, 400
    logits = torch.randn(v) * 2
    t = 0.7
    sampler = Sampler(v, "cpu")
    keys = row_keys(np.arange(draws), np.zeros(draws), np.zeros(draws))
    out = sampler(logits.expand(draws, v), rows(draws, t, k, p, mp, keys=keys))
    got = set(out.tokens.tolist())
    want = allowed_reference(logits, t, k, p, mp)
    assert got <= want
    if len(want) <= 8:  # 400 draws hit every allowed token of a small set
        assert got == want


_R = torch.randn(32, generator=torch.Generator().manual_seed(5)) * 1.5
_ISSUE = torch.log(torch.tensor([.48, .22, .16, .09] + [.0025] * 20))  # min-p first keeps 3 of them
_TIES = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5] + [0.0] * 11)
_NEAR = torch.tensor([2.0, 1.0, 1.0 - 2 ** -20, 0.5] + [0.0] * 12)
_NEAR_P = exact_probs(_NEAR, 1.0, -1, 1.0, 0.0)
DISTRIBUTIONS = {  # name: (logits, temperature, top_k, top_p, min_p)
    "T1": (_R, 1.0, -1, 1.0, 0.0),
    "T0.5": (_R, 0.5, -1, 1.0, 0.0),
    "T2": (_R, 2.0, -1, 1.0, 0.0),
    "top_k": (_R, 0.8, 5, 1.0, 0.0),
    "top_p": (_R, 1.2, -1, 0.6, 0.0),
    "min_p": (_R, 1.0, -1, 1.0, 0.05),
    "all_three": (_R, 0.7, 10, 0.8, 0.02),
    "min_p_before_top_p": (_ISSUE, 1.0, -1, 0.9, 0.1),
    "top_k_ties": (_TIES, 1.0, 2, 1.0, 0.0),
    "top_p_ties": (_TIES, 1.0, -1, 0.4, 0.0),
    "top_k_near_ties": (_NEAR, 1.0, 2, 1.0, 0.0),
    "top_p_near_ties": (_NEAR, 1.0, -1, (_NEAR_P[0] + _NEAR_P[1] / 2).item(), 0.0),
    "top_k_1": (_R, 1.0, 1, 1.0, 0.0),
}


@pytest.mark.kernel
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_draws_follow_the_exact_distribution(name):
    """20,000 draws (one row each, distinct keys) against the rule's exact probabilities: no token
    outside the kept set, and Pearson's chi-square p-value > 1e-4."""
    logits, t, k, p, mp = DISTRIBUTIONS[name]
    v, n = logits.numel(), 20_000
    keys = row_keys(np.full(n, 7), np.arange(n), np.zeros(n))
    out = Sampler(v, "cpu")(logits.expand(n, v), rows(n, t, k, p, mp, keys=keys))
    counts = torch.bincount(out.tokens, minlength=v).double()
    probs = exact_probs(logits, t, k, p, mp)
    pval = chi_square_pvalue(counts, probs)
    assert pval > 1e-4, (name, pval, counts.tolist(), (probs * n).tolist())


def test_the_rule_keeps_what_vllm_keeps():
    """The cases of the rule by hand: min-p before top-p, ties with the k-th, tied tokens at top-p."""
    assert allowed_reference(*DISTRIBUTIONS["min_p_before_top_p"][:1], 1.0, -1, 0.9, 0.1) == {0, 1, 2}
    assert allowed_reference(_TIES, 1.0, 2, 1.0, 0.0) == {0, 1, 2, 3}
    assert allowed_reference(_TIES, 1.0, -1, 0.4, 0.0) == {0, 1, 2, 3}
    assert allowed_reference(_NEAR, 1.0, 2, 1.0, 0.0) == {0, 1}
    assert allowed_reference(*DISTRIBUTIONS["top_p_near_ties"][:4], 0.0) == {0, 1}


def test_draws_follow_softmax_of_logits_over_temperature():
    torch.manual_seed(2)
    v, n, t = 6, 20000, 1.5
    logits = torch.randn(v)
    keys = row_keys(np.full(n, 99), np.arange(n), np.zeros(n))
    out = Sampler(v, "cpu")(logits.expand(n, v), rows(n, t, keys=keys))
    freq = torch.bincount(out.tokens, minlength=v).double() / n
    want = torch.softmax(logits.double() / t, 0)
    assert (freq - want).abs().max() < 0.015, (freq, want)


def test_a_row_depends_on_its_key_and_logits_only():
    torch.manual_seed(3)
    v = 1000
    logits = torch.randn(8, v)
    keys = row_keys(np.arange(8), np.arange(8), np.arange(8))
    sampler = Sampler(v, "cpu")
    full = sampler(logits, rows(8, 1.0, keys=keys)).tokens
    perm = torch.randperm(8)
    again = sampler(logits[perm], rows(8, 1.0, keys=keys[perm.numpy()])).tokens
    assert torch.equal(again, full[perm])
    mixed = sampler(logits, rows(8, [1.0, 0.0] * 4, top_k=[-1, 5] * 4, keys=keys)).tokens
    assert torch.equal(mixed[0::2], full[0::2])  # other rows' settings do not change a row
    assert torch.equal(mixed[1::2], logits[1::2].argmax(-1))


def test_wrong_vocab_width_is_refused():
    with pytest.raises(ValueError, match="logits"):
        Sampler(10, "cpu")(torch.zeros(2, 11), rows(2))


def test_settings_and_sample_are_the_samplers_draw():
    """``settings``: each batch's mode (which steps the draw runs: what the engine's decode graphs fix)
    and its per-row values, made once for the same arrays; ``sample`` on them, on the device with no
    host work, gives the sampler's own tokens and log-probabilities (top ones too) in every mode."""
    torch.manual_seed(4)
    v = 3000
    logits = torch.randn(6, v)
    sampler = Sampler(v, "cpu")
    keys = row_keys(np.arange(6), np.arange(6), np.full(6, 2))
    cases = [(dict(temperature=[0.7, 1.3] * 3), SampleMode()),
             (dict(temperature=[0.7, 0.0] * 3), SampleMode(any_greedy=True)),
             (dict(temperature=0.0), SampleMode(any_greedy=True, all_greedy=True)),
             (dict(top_k=5), SampleMode(any_k=True, top_k_width=8)), (dict(top_k=v), SampleMode()),
             (dict(top_k=[5, 2000, v] * 2), SampleMode(any_k=True, top_k_width=2048)),
             (dict(top_k=5, top_p=0.9), SampleMode(any_k=True, any_p=True, top_k_width=8)),
             (dict(top_k=[5, 5, v] * 2, top_p=[0.9, 1.0, 1.0] * 2), SampleMode(any_k=True, any_p=True, top_k_width=8)),
             (dict(top_k=[5, 5, v] * 2, top_p=0.9), SampleMode(any_k=True, any_p=True, top_k_width=8)),
             (dict(top_p=0.9), SampleMode(any_p=True)), (dict(min_p=0.1), SampleMode(any_min_p=True)),
             (dict(num_logprobs=2), SampleMode(num_logprobs=2)), (dict(num_logprobs=v + 5), SampleMode(num_logprobs=v))]
    for kw, mode in cases:
        r = rows(6, **{"temperature": 1.0, **kw, "keys": keys})
        st = sampler.settings(r)
        assert st.mode == mode and st.mode.plain == (mode == SampleMode()) and sampler.settings(r) is st
        want = sampler(logits, r)
        got = sampler.sample(logits, st.mode, *map(torch.from_numpy, (st.k, st.temp, st.min_p, st.top_p, st.greedy,
                                                                     r.key.astype(np.int64))))
        for a, b in ((got.tokens, want.tokens), (got.logprobs, want.logprobs), (got.top_ids, want.top_ids),
                     (got.top_logprobs, want.top_logprobs)):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_filters_keep_the_rules_set_in_every_row(device):
    """The rows' floors (min-p, then top-k from a ``torch.topk`` window, then top-p over the rest) keep
    exactly the rule's tokens in every row of a batch with mixed settings: ties with the k-th (many
    beyond the window), rows without top-k, -inf entries, top-p from 1e-6 (the most likely tokens
    only) to off; on the GPU the same sets as the CPU's, with a vocabulary of SmolLM2's size too."""
    from paged_backend.integration.sampler import _floors
    g = torch.Generator().manual_seed(5)
    for v in (7, 300) + ((49152,) if device == "cuda" else ()):
        x = torch.randint(-4, 5, (9, v), generator=g).float() / 2  # (many ties)
        x[0, :3] = float("-inf")
        x[5, 1:] = float("-inf")  # (one finite token)
        k = torch.tensor([1, 2, 3, min(5, v - 1), v, v, 1, min(6, v - 1), min(40, v - 1)])
        mp = torch.tensor([0.0, 0.0, 0.3, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0])
        for top_p in (1e-6, 0.3, 0.9, 0.999, float("inf")):
            p = torch.tensor([top_p, 1.0, top_p, top_p, top_p, 1.0, top_p, 1.0, top_p]).clamp(max=1.0)
            st = Sampler(v, "cpu").settings(rows(9, top_k=k.numpy(), top_p=p.numpy(), min_p=mp.numpy()))
            kept = {}
            for d in {"cpu", device}:
                floors = _floors(x.to(d), st.mode, *(torch.from_numpy(a).to(d) for a in (st.k, st.min_p, st.top_p)))
                kept[d] = ((x.to(d) >= floors[:, None]) & (x.to(d) > float("-inf"))).cpu()
            assert torch.equal(kept[device], kept["cpu"]), (v, top_p)  # (the GPU's search, the CPU's sort)
            for r in range(9 if v <= 300 else 0):  # (the plain rule is quadratic in V)
                want = allowed_reference(x[r], 1.0, int(k[r]), float(p[r]), float(mp[r]))
                assert set(kept[device][r].nonzero().flatten().tolist()) == want, (v, top_p, r)
