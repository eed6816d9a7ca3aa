"""copy_blocks (copy-on-write block copies) against direct indexing."""
import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_inputs import make_cache

pytestmark = pytest.mark.kernel


def _layers(n, nb, bs, hkv, d, dtype, layout):
    ks, vs = [], []
    for _ in range(n):
        k, v = make_cache(nb, bs, hkv, d, dtype, layout=layout)
        ks.append(k)
        vs.append(v)
    return ks, vs


def _expected(caches, pairs):
    out = []
    for c in caches:
        w = c.clone()
        for s, t in pairs:
            w[t] = c[s]  # every copy reads the state before the call
        out.append(w)
    return out


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_copies_blocks_in_every_layer(layout, dtype, num_layers):
    torch.manual_seed(num_layers)
    nb, bs, hkv, d = 9, 4, 2, 64
    ks, vs = _layers(num_layers, nb, bs, hkv, d, dtype, layout)
    pairs = [(1, 5), (1, 6), (3, 0), (2, 2)]  # one src to two dsts, and a no-op
    want_k, want_v = _expected(ks, pairs), _expected(vs, pairs)
    pb.copy_blocks(ks, vs, torch.tensor(pairs, dtype=torch.int64))
    for k, v, wk, wv in zip(ks, vs, want_k, want_v):
        assert torch.equal(k, wk) and torch.equal(v, wv)


@pytest.mark.parametrize("bs,hkv,d", [(1, 1, 64), (4, 3, 80), (64, 1, 128)])  # masked tail; 2 chunks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shapes(bs, hkv, d, dtype):
    torch.manual_seed(bs)
    ks, vs = _layers(2, 5, bs, hkv, d, dtype, "vllm")
    pairs = [(0, 4), (3, 1)]
    want = _expected(ks + vs, pairs)
    pb.copy_blocks(ks, vs, torch.tensor(pairs))
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, want))


def test_single_tensor_and_numpy_copies():
    torch.manual_seed(0)
    k, v = make_cache(6, 2, 1, 80, torch.float32, layout="vllm")
    pairs = np.array([[0, 3], [4, 1]], dtype=np.int64)
    want_k, want_v = _expected([k], pairs.tolist())[0], _expected([v], pairs.tolist())[0]
    pb.copy_blocks(k, v, pairs)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_layers_with_different_strides():
    # a contiguous layer and a vLLM-strided layer in one call (two launches on the kernel path)
    torch.manual_seed(1)
    k0, v0 = make_cache(5, 2, 2, 64, torch.float32, layout="nhd")
    k1, v1 = make_cache(5, 2, 2, 64, torch.float32, layout="vllm")
    pairs = [(4, 0), (2, 3)]
    want = _expected([k0, k1, v0, v1], pairs)
    pb.copy_blocks((k0, k1), (v0, v1), torch.tensor(pairs))
    assert all(torch.equal(a, b) for a, b in zip([k0, k1, v0, v1], want))


def test_vllm_buffer_untouched_outside_dst():
    # K and V are views of one buffer: a copy must touch exactly the dst block's K and V halves
    torch.manual_seed(2)
    k, v = make_cache(4, 2, 2, 64, torch.float16, layout="vllm")
    before = k.clone(), v.clone()
    pb.copy_blocks([k], [v], torch.tensor([[3, 1]]))
    assert torch.equal(k[[0, 2, 3]], before[0][[0, 2, 3]]) and torch.equal(v[[0, 2, 3]], before[1][[0, 2, 3]])
    assert torch.equal(k[1], before[0][3]) and torch.equal(v[1], before[1][3])


@pytest.mark.parametrize("pairs", [[], [[2, 2]], [[0, 0], [1, 1]]])
def test_empty_and_self_copies_are_noops(pairs):
    ks, vs = _layers(2, 4, 2, 1, 64, torch.float32, "nhd")
    before = [c.clone() for c in ks + vs]
    pb.copy_blocks(ks, vs, torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2))
    pb.copy_blocks(ks, vs, np.zeros((0, 2), np.int64))
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, before))


def test_self_copy_of_a_src_is_allowed():
    ks, vs = _layers(1, 4, 2, 1, 64, torch.float32, "nhd")
    pairs = [(1, 1), (1, 3)]
    want = _expected(ks + vs, pairs)
    pb.copy_blocks(ks, vs, torch.tensor(pairs))
    assert all(torch.equal(a, b) for a, b in zip(ks + vs, want))


def test_after_fork_decode_reads_copied_block():
    # scheduler-style copy-on-write: sample 2's shared partial block is copied, then written
    torch.manual_seed(3)
    nb, bs, hkv, d = 6, 4, 1, 64
    k, v = make_cache(nb, bs, hkv, d, torch.float32)
    pb.copy_blocks(k, v, np.array([[2, 5]], np.int64))
    key, value = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    pb.write_kv(key, value, k, v, torch.tensor([5 * bs + 3]))
    assert torch.equal(k[5, :3], k[2, :3]) and torch.equal(k[5, 3], key[0])
    assert not torch.equal(k[2, 3], key[0])


def test_bad_inputs():
    k, v = make_cache(4, 2, 1, 64, torch.float32)
    ok = torch.tensor([[0, 1]])
    cases = [
        ((k, v, [[0, 1]]), TypeError, "block_copies"),
        ((k, v, ok.int()), TypeError, "block_copies"),
        ((k, v, np.array([[0, 1]], np.int32)), TypeError, "block_copies"),
        ((k, v, torch.tensor([0, 1])), ValueError, "block_copies"),
        ((k, v, torch.zeros(1, 3, dtype=torch.int64)), ValueError, "block_copies"),
        ((k, v, torch.tensor([[0, 4]])), ValueError, "outside"),
        ((k, v, torch.tensor([[-1, 2]])), ValueError, "outside"),
        ((k, v, torch.tensor([[0, 2], [1, 2]])), ValueError, "more than once"),
        ((k, v, torch.tensor([[0, 1], [1, 2]])), ValueError, "chains"),
        ((k, v, torch.tensor([[1, 2], [0, 1]])), ValueError, "chains"),
        (("k", v, ok), TypeError, "k_caches"),
        ((k, {"v": v}, ok), TypeError, "v_caches"),
        (([k, k.clone()], [v], ok), ValueError, "v_caches"),
        (([], [], ok), ValueError, "k_caches"),
        (([k, k[:3]], [v, v.clone()], ok), ValueError, r"k_caches\[1\]"),
        (([k], [v.half()], ok), TypeError, r"v_caches\[0\]"),
        (([k], [v[0]], ok), ValueError, r"v_caches\[0\]"),
        (([k.long()], [v], ok), TypeError, r"k_caches\[0\]"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            pb.copy_blocks(*args)


def test_bad_ids_leave_cache_untouched():
    k, v = make_cache(4, 2, 1, 64, torch.float32)
    before = k.clone(), v.clone()
    with pytest.raises(ValueError, match="outside"):
        pb.copy_blocks(k, v, torch.tensor([[0, 1], [0, 9]]))
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_kernel_skips_out_of_range_ids():
    # the launchers themselves (what runs on the GPU without PAGED_BACKEND_DEBUG) never write a
    # pair with an id outside [0, NB)
    from paged_backend.kernels.copy_blocks import copy_blocks_torch, copy_blocks_triton
    from paged_backend.kernels.dispatch import INTERPRET
    fn = copy_blocks_triton if INTERPRET else copy_blocks_torch
    k, v = make_cache(4, 2, 1, 64, torch.float32)
    want = _expected([k, v], [(0, 2)])
    fn([k], [v], torch.tensor([[0, 2], [5, 1], [1, -1], [-3, 3], [1, 4]]))
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_gpu_copies_in_every_layer(layout):
    layers = [make_cache(64, 16, 8, 128, torch.bfloat16, device="cuda", layout=layout) for _ in range(3)]
    before = [(k.clone(), v.clone()) for k, v in layers]
    pairs = torch.tensor([[3, 40], [3, 41], [7, 2], [60, 61]], dtype=torch.int64)
    pb.copy_blocks([k for k, _ in layers], [v for _, v in layers], pairs.cuda())
    torch.cuda.synchronize()
    for (k, v), (k0, v0) in zip(layers, before):
        want_k, want_v = k0.clone(), v0.clone()
        want_k[pairs[:, 1].cuda()] = k0[pairs[:, 0].cuda()]
        want_v[pairs[:, 1].cuda()] = v0[pairs[:, 0].cuda()]
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
