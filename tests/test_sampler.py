"""The engine's batched sampler: greedy, filters (top-k, top-p, min-p) against a plain reference,
draws distributed as softmax(logits / T), and samples that depend on (seed, index, position) only."""
import numpy as np
import pytest
import torch

from paged_backend.integration.sampler import SampleRows, Sampler, row_keys
from paged_backend.sample import mix32


def rows(s, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, keys=None, num_logprobs=0):
    full = lambda v, dt: np.full(s, v, dt) if np.isscalar(v) else np.asarray(v, dt)  # noqa: E731
    return SampleRows(full(temperature, np.float32), full(top_k, np.int64), full(top_p, np.float32),
                      full(min_p, np.float32), row_keys(np.arange(s), np.zeros(s), np.zeros(s)) if keys is None
                      else keys, num_logprobs)


def allowed_reference(logits, t, k, p, mp):
    """The set of token ids a row may draw, by sorting in Python."""
    x = logits.double() / t
    order = torch.argsort(x, descending=True).tolist()
    keep = order[:k] if k > 0 else order
    probs = torch.softmax(x[keep], 0).tolist()
    out, mass = [], 0.0
    for tok, pr in zip(keep, probs):
        if mass >= p:
            break
        out.append(tok)
        mass += pr
    pmax = torch.softmax(x, 0).max().item()
    full = torch.softmax(x, 0)
    return {i for i in out if full[i].item() >= mp * pmax}


def test_hash_is_the_same_on_numpy_and_torch_and_looks_uniform():
    x = np.arange(0, 2 ** 32, 2 ** 32 // 4099, dtype=np.uint64).astype(np.uint32)
    a = mix32(x)
    b = mix32(torch.from_numpy(x.astype(np.int64))).numpy().astype(np.uint32)
    assert np.array_equal(a, b)
    sampler = Sampler(50_000, "cpu")
    h = mix32(torch.tensor([12345])[:, None] ^ sampler._vocab_hash[None, :])[0]
    u = ((h >> 8).double() + 0.5) / (1 << 24)
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
