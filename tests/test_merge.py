"""merge_states / merge_states_many against fp64 attention over the union of key sets."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_backend as pb
from paged_backend.kernels.dispatch import INTERPRET
from reference import TOL, attend, rel_err

pytestmark = pytest.mark.kernel

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


def states_from_splits(t, h, d, sizes, dtype, seed):
    """States of one query set over consecutive key chunks of ``sizes``, and the reference over all."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(sum(sizes), h, d, generator=g)
    v = torch.randn(sum(sizes), h, d, generator=g)
    parts, at = [], 0
    for n in sizes:
        o, lse = attend(q, k[at:at + n], v[at:at + n], d ** -0.5)
        parts.append((o.to(dtype), lse.float()))
        at += n
    ref = attend(q, k, v, d ** -0.5)
    return parts, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 80, 128])
def test_merge_two_equals_attention_over_union(dtype, d):
    (a, b), (ref_o, ref_lse) = states_from_splits(6, 4, d, [30, 50], dtype, seed=d)
    o, lse = pb.merge_states(*a, *b)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(o, ref_o) <= max(TOL[dtype], 1e-6) * 2
    assert (lse.double() - ref_lse).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_many(dtype):
    parts, (ref_o, ref_lse) = states_from_splits(5, 3, 64, [1, 40, 0, 7, 100], dtype, seed=1)
    o, lse = pb.merge_states_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert rel_err(o, ref_o) <= max(TOL[dtype], 1e-6) * 2
    assert (lse.double() - ref_lse).abs().max() <= 1e-4


def test_empty_states_are_identity_and_never_nan():
    (a, b), _ = states_from_splits(4, 2, 64, [10, 12], torch.float32, seed=3)
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    o, lse = pb.merge_states(*a, *empty)
    assert torch.equal(o, a[0]) and torch.equal(lse, a[1])
    o, lse = pb.merge_states(*empty, *b)
    assert torch.equal(o, b[0]) and torch.equal(lse, b[1])
    o, lse = pb.merge_states(*empty, *empty)
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
    o, lse = pb.merge_states_many(torch.stack([empty[0]] * 3), torch.stack([empty[1]] * 3))
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))


def test_huge_lse_gap():
    o_a, o_b = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    lse_a = torch.full((2, 3), 1e4)
    lse_b = torch.full((2, 3), -1e4)
    o, lse = pb.merge_states(o_a, lse_a, o_b, lse_b)
    assert torch.allclose(o, o_a) and torch.allclose(lse, lse_a)


def test_non_contiguous_inputs():
    (a, b), (ref_o, _) = states_from_splits(4, 6, 64, [9, 9], torch.float32, seed=5)
    a_o = a[0].transpose(0, 1).contiguous().transpose(0, 1)
    b_lse = b[1].t().contiguous().t()
    o, _ = pb.merge_states(a_o, a[1], b[0], b_lse)
    assert rel_err(o, ref_o) <= 1e-5


lse_values = st.one_of(st.just(float("-inf")), st.floats(-50, 50))


@settings(max_examples=25 if INTERPRET else 100, deadline=None, derandomize=True)
@given(lses=st.lists(st.lists(lse_values, min_size=4, max_size=4), min_size=3, max_size=3),
       seed=st.integers(0, 2 ** 16))
def test_associative_and_commutative(lses, seed):
    g = torch.Generator().manual_seed(seed)
    os_ = [torch.randn(2, 2, 64, generator=g) for _ in range(3)]
    ls = [torch.tensor(x, dtype=torch.float32).view(2, 2) for x in lses]
    for i in range(3):  # empty states carry o = 0 by contract
        os_[i][torch.isinf(ls[i])] = 0.0
    s = list(zip(os_, ls))
    ab_c = pb.merge_states(*pb.merge_states(*s[0], *s[1]), *s[2])
    a_bc = pb.merge_states(*s[0], *pb.merge_states(*s[1], *s[2]))
    ba = pb.merge_states(*s[1], *s[0])
    ab = pb.merge_states(*s[0], *s[1])
    for x, y in ((ab_c, a_bc), (ab, ba)):
        assert not torch.isnan(x[0]).any() and not torch.isnan(x[1]).any()
        assert torch.allclose(x[0], y[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isinf(x[1]), torch.isinf(y[1]))
        fin = torch.isfinite(x[1])
        assert torch.allclose(x[1][fin], y[1][fin], atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_plus_inf_lse_is_an_empty_state(device):
    """FlashAttention-2 marks a row without keys with lse = +inf; like vLLM's merge, it is read as
    empty (-inf), and an empty state adds nothing even where its o holds NaN."""
    (a, b), _ = states_from_splits(4, 2, 64, [10, 12], torch.float32, seed=4)
    a, b = [x.to(device) for x in a], [x.to(device) for x in b]
    inf_o = torch.full_like(a[0], float("nan"))
    inf_lse = a[1].clone()
    inf_lse[1:3] = float("inf")
    inf_o[0] = a[0][0]  # row 0 is a real state
    o, lse = pb.merge_states(inf_o, inf_lse, *b)
    assert torch.allclose(o[1:3], b[0][1:3]) and torch.equal(lse[1:3], b[1][1:3])
    ref_o, ref_lse = pb.merge_states(a[0][:1], a[1][:1], b[0][:1], b[1][:1])
    assert torch.equal(o[0], ref_o[0]) and torch.equal(lse[0], ref_lse[0])
    o, lse = pb.merge_states_many(torch.stack([inf_o, b[0], inf_o]), torch.stack([inf_lse, b[1], inf_lse]))
    assert torch.allclose(o[1:3], b[0][1:3]) and torch.equal(lse[1:3], b[1][1:3])
    all_inf = torch.full_like(a[1], float("inf"))
    o, lse = pb.merge_states(inf_o, all_inf, inf_o, all_inf)
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))
