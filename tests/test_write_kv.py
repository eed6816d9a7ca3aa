"""write_kv (reshape_and_cache) against direct indexing."""
import pytest
import torch

import paged_backend as pb
from paged_inputs import make_cache

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("bs", [1, 16, 256])
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_writes_exactly_the_mapped_slots(bs, layout, dtype):
    torch.manual_seed(bs)
    nb, hkv, d, t = 12, 2, 80, 11
    k_cache, v_cache = make_cache(nb, bs, hkv, d, dtype, layout=layout)
    k0, v0 = k_cache.clone(), v_cache.clone()
    key = torch.randn(t, hkv, d).to(dtype)
    value = torch.randn(t, hkv, d).to(dtype)
    slots = torch.randperm(nb * bs)[:t].long()
    slots[3] = -1
    slots[7] = -1
    pb.write_kv(key, value, k_cache, v_cache, slots)
    want_k, want_v = k0.clone(), v0.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs] = key[i]
            want_v[s // bs, s % bs] = value[i]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_empty_batch_is_noop():
    k_cache, v_cache = make_cache(2, 16, 2, 64, torch.float32)
    k0 = k_cache.clone()
    pb.write_kv(torch.empty(0, 2, 64), torch.empty(0, 2, 64), k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_cache, k0)


def test_then_decode_reads_what_was_written():
    torch.manual_seed(0)
    nb, bs, hkv, d = 8, 4, 2, 64
    k_cache, v_cache = make_cache(nb, bs, hkv, d, torch.float32)
    key, value = torch.randn(10, hkv, d), torch.randn(10, hkv, d)
    bt = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    slots = torch.tensor([5 * bs + i for i in range(4)] + [2 * bs + i for i in range(4)] + [7 * bs, 7 * bs + 1])
    pb.write_kv(key, value, k_cache, v_cache, slots)
    q = torch.randn(1, 4, d)
    out, lse = pb.paged_decode(q, k_cache, v_cache, bt, torch.tensor([10], dtype=torch.int32))
    kk = key.repeat_interleave(2, dim=1)
    vv = value.repeat_interleave(2, dim=1)
    s = torch.einsum("hd,khd->hk", q[0], kk) * d ** -0.5
    ref = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv)
    assert torch.allclose(out[0], ref, atol=1e-5)
    assert torch.allclose(lse[0], torch.logsumexp(s, -1), atol=1e-5)
