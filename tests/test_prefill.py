"""pb.paged_prefill against the dense fp64 causal reference.

Runs on the torch CPU path by default and on the Triton kernels with TRITON_INTERPRET=1 (bf16 only
on the torch path: the interpreter cannot do bf16 arithmetic). Shapes are small so the whole file
stays fast in the interpreter; tests marked ``gpu`` use long sequences and bf16.
"""
from __future__ import annotations

import pytest
import torch

import paged_backend as pb
from paged_backend.kernels.dispatch import INTERPRET
from paged_backend.kernels.prefill_torch import prefill_torch
from tests.paged_inputs import make_block_table, make_cache
from tests.reference import assert_close_state, decode_reference, prefill_reference

pytestmark = pytest.mark.kernel

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU_DTYPES = [F32, F16, pytest.param(BF16, marks=pytest.mark.skipif(
    INTERPRET, reason="the Triton interpreter cannot do bf16 arithmetic; bf16 kernels are tested on the GPU"))]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_prefill_inputs(q_lens, seq_lens, hq, hkv, d, bs, dtype, device="cpu", layout="nhd", q_scale=1.0,
                        spare_blocks=3, extra_cols=0):
    """-> (q [T, Hq, D], k_cache, v_cache, block_table, seq_lens, query_start_loc)."""
    need = sum(-(-int(n) // bs) for n in seq_lens)
    nb = need + spare_blocks
    k, v = make_cache(nb, bs, hkv, d, dtype, device, layout)
    bt = make_block_table(seq_lens, bs, nb, extra_cols=extra_cols, device=device)
    t = sum(q_lens)
    q = (torch.randn(t, hq, d, device=device) * q_scale).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(list(q_lens), dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                       device=device)
    return q, k, v, bt, torch.tensor(list(seq_lens), dtype=torch.int32, device=device), qsl


def device_reference(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, causal=True, rows=1024):
    """fp64 dense reference computed on q's device (for the long GPU cases), chunked over queries."""
    d, hq, hkv, bs = q.shape[-1], q.shape[1], k_cache.shape[2], k_cache.shape[1]
    qsl = query_start_loc.tolist()
    outs, lses = [], []
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        pages = block_table[b].long()[pos // bs]
        k = k_cache[pages, pos % bs].double().repeat_interleave(hq // hkv, 1)
        v = v_cache[pages, pos % bs].double().repeat_interleave(hq // hkv, 1)
        q_len = qsl[b + 1] - qsl[b]
        for i in range(0, q_len, rows):
            qi = torch.arange(i, min(q_len, i + rows), device=q.device)
            s = torch.einsum("qhd,khd->hqk", q[qsl[b] + qi].double(), k) * d ** -0.5
            if causal:
                s = s.masked_fill(pos[None, None, :] > (n - q_len + qi)[None, :, None], float("-inf"))
            lse = torch.logsumexp(s, -1)
            outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v).cpu())
            lses.append(lse.transpose(0, 1).cpu())
    return torch.cat(outs), torch.cat(lses)


def check(q_lens, seq_lens, hq, hkv, d, bs, dtype, causal=True, **kw):
    q, k, v, bt, sl, qsl = make_prefill_inputs(q_lens, seq_lens, hq, hkv, d, bs, dtype, **kw)
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    if q.is_cuda:
        ref_o, ref_lse = device_reference(q, k, v, bt, sl, qsl, causal=causal)
    else:
        ref_o, ref_lse = prefill_reference(q, k, v, bt, sl, qsl, causal=causal)
    assert_close_state(out, lse, ref_o, ref_lse, dtype)
    return out, lse


# --- block sizes x GQA x head dims; each batch has a chunk starting mid-page, a whole prompt and a decode.
GQAS = [(4, 4), (8, 2), (8, 1), (32, 1), (6, 2)]  # group 1, 4, 8 and 32 (MQA), 3 (not a power of two)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("bs", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("gqa", range(len(GQAS)))
def test_block_sizes_and_gqa(bs, gqa, dtype):
    hq, hkv = GQAS[gqa]
    d = (64, 80, 128)[(gqa + bs) % 3]
    # chunk of 19 tokens starting at bs + 3 (never page-aligned), a whole 11-token prompt, a decode.
    check([19, 11, 1], [bs + 22, 11, 2 * bs + 1], hq, hkv, d, bs, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("d", [64, 80, 128])
def test_head_dims(d, dtype):
    check([13, 4], [29, 4], 8, 2, d, 16, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_causal_flag(causal, dtype):
    check([9, 1, 24], [20, 7, 24], 8, 2, 64, 4, dtype, causal=causal)


@pytest.mark.parametrize("start", [0, 1, 15, 16, 17, 40])
@pytest.mark.parametrize("q_len", [1, 6, 33])
def test_chunk_starts_not_aligned(start, q_len):
    # The chunk's first query sits at key position `start` (tokens already cached before it).
    check([q_len], [start + q_len], 4, 2, 64, 16, F32)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_mixed_batch(dtype):
    # long chunk + decodes + an empty request with cached tokens + an empty request with none.
    q_lens = [37, 1, 0, 1, 0, 5, 1]
    seq_lens = [50, 9, 12, 1, 0, 5, 64]
    check(q_lens, seq_lens, 8, 2, 64, 16, dtype)


def test_all_empty_requests():
    q, k, v, bt, sl, qsl = make_prefill_inputs([0, 0], [5, 0], 4, 2, 64, 4, F32)
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_q_len_one_equals_decode(bs, dtype):
    seq_lens = [1, bs - 1 if bs > 1 else 2, bs, bs + 1, 45]
    q, k, v, bt, sl, qsl = make_prefill_inputs([1] * 5, seq_lens, 8, 2, 64, bs, dtype)
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl)
    dec_o, dec_lse = pb.paged_decode(q, k, v, bt, sl)
    ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
    assert_close_state(out, lse, ref_o, ref_lse, dtype)
    assert_close_state(out, lse, dec_o, dec_lse.double(), dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_vllm_strided_cache(dtype):
    q, k, v, bt, sl, qsl = make_prefill_inputs([10, 1, 7], [21, 6, 7], 8, 2, 64, 16, dtype, layout="vllm")
    assert not k.is_contiguous()
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl)
    ref_o, ref_lse = prefill_reference(q, k, v, bt, sl, qsl)
    assert_close_state(out, lse, ref_o, ref_lse, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_huge_logits(dtype):
    check([17, 1], [30, 8], 4, 2, 64, 4, dtype, q_scale=30.0)


def test_strided_q_and_scale():
    q, k, v, bt, sl, qsl = make_prefill_inputs([7, 3], [12, 3], 8, 2, 64, 4, F32)
    q_big = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])
    q_big[..., ::2] = q
    q_view = q_big[..., ::2]
    out, lse = pb.paged_prefill(q_view, k, v, bt, sl, qsl, scale=0.3)
    ref_o, ref_lse = prefill_reference(q, k, v, bt, sl, qsl, scale=0.3)
    assert_close_state(out, lse, ref_o, ref_lse, F32)


def test_return_lse_false_and_host_copies():
    q, k, v, bt, sl, qsl = make_prefill_inputs([6, 2], [9, 2], 4, 2, 64, 4, F32)
    out = pb.paged_prefill(q, k, v, bt, sl, qsl, return_lse=False,
                           query_start_loc_cpu=qsl.clone(), seq_lens_cpu=sl.tolist())
    assert isinstance(out, torch.Tensor)
    ref_o, _ = prefill_reference(q, k, v, bt, sl, qsl)
    assert_close_state(out, None, ref_o, None, F32)


def test_state_merges_with_decode():
    # The prefill of the first n-1 keys (non-causal q_len 1) merged with the state of the last key
    # equals the decode over all n keys: the LSE is natural log like every other state.
    n = 23
    q, k, v, bt, sl, qsl = make_prefill_inputs([1], [n], 4, 2, 64, 4, F32)
    o_all, lse_all = pb.paged_decode(q, k, v, bt, sl)
    o_a, lse_a = pb.paged_prefill(q, k, v, bt, sl - 1, qsl, causal=False)
    # state of the last key alone: a one-token table pointing at its page/row is not expressible
    # with shared pages, so build it densely
    page, row = bt[0, (n - 1) // 4].long(), (n - 1) % 4
    kl, vl = k[page, row].repeat_interleave(2, 0), v[page, row].repeat_interleave(2, 0)  # [Hq, D]
    lse_b = (q[0] * kl).sum(-1) * 64 ** -0.5
    o, lse = pb.merge_states(o_a, lse_a, vl[None].contiguous(), lse_b[None].contiguous())
    assert_close_state(o, lse, o_all.double(), lse_all.double(), F32)


def test_torch_chunking():
    # Tiny budget: queries are cut into many chunks, grouped across requests.
    q, k, v, bt, sl, qsl = make_prefill_inputs([13, 1, 0, 8], [20, 4, 3, 8], 4, 2, 64, 4, F32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    prefill_torch(q, k, v, bt, sl, qsl, 64 ** -0.5, True, out, lse, budget=400)
    ref_o, ref_lse = prefill_reference(q, k, v, bt, sl, qsl)
    assert_close_state(out, lse, ref_o, ref_lse, F32)


@pytest.mark.skipif(not INTERPRET, reason="kernel tile variants run in the Triton interpreter (or on a GPU)")
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 32)])
def test_kernel_tile_sizes(block_m, block_n):
    from paged_backend.kernels.prefill import prefill_triton
    q, k, v, bt, sl, qsl = make_prefill_inputs([21, 1, 3], [40, 17, 3], 8, 1, 64, 4, F32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    prefill_triton(q, k, v, bt, sl, qsl, 64 ** -0.5, True, out, lse, block_m=block_m, block_n=block_n)
    ref_o, ref_lse = prefill_reference(q, k, v, bt, sl, qsl)
    assert_close_state(out, lse, ref_o, ref_lse, F32)


# --- bad inputs: each names the argument.

def _good():
    return make_prefill_inputs([5, 3], [9, 3], 4, 2, 64, 4, F32)


def _qsl(vals):
    return torch.tensor(vals, dtype=torch.int32)


@pytest.mark.parametrize("vals,match", [
    ([0, 6, 5], "query_start_loc must be monotone non-decreasing"),
    ([0, 5, 7], "query_start_loc must end at T"),
    ([0, 5, 9], "query_start_loc must end at T"),
    ([1, 5, 8], "query_start_loc must start at 0"),
    ([0, 8], "query_start_loc must have"),
    ([0, 0, 5, 8], "query_start_loc must have"),
])
def test_bad_query_start_loc(vals, match):
    q, k, v, bt, sl, _ = _good()
    with pytest.raises(ValueError, match=match):
        pb.paged_prefill(q, k, v, bt, sl, _qsl(vals))


def test_bad_query_start_loc_host_copy():
    q, k, v, bt, sl, qsl = _good()
    with pytest.raises(ValueError, match="query_start_loc"):
        pb.paged_prefill(q, k, v, bt, sl, qsl, query_start_loc_cpu=[0, 9, 8])
    with pytest.raises(ValueError, match="query_start_loc_cpu"):
        pb.paged_prefill(q, k, v, bt, sl, qsl, query_start_loc_cpu=[0, 8])
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        pb.paged_prefill(q, k, v, bt, sl, qsl, seq_lens_cpu=[9])


def test_q_len_over_seq_len():
    q, k, v, bt, _, qsl = _good()
    with pytest.raises(ValueError, match=r"query_start_loc.*q_len 3 > seq_lens\[1\] = 2"):
        pb.paged_prefill(q, k, v, bt, torch.tensor([9, 2], dtype=torch.int32), qsl)


def test_bad_types_and_shapes():
    q, k, v, bt, sl, qsl = _good()
    with pytest.raises(TypeError, match="query_start_loc"):
        pb.paged_prefill(q, k, v, bt, sl, qsl.long())
    with pytest.raises(ValueError, match="query_start_loc"):
        pb.paged_prefill(q, k, v, bt, sl, qsl[None])
    with pytest.raises(TypeError, match="query_start_loc"):
        pb.paged_prefill(q, k, v, bt, sl, qsl.tolist())
    with pytest.raises(TypeError, match="q dtype"):
        pb.paged_prefill(q.half(), k, v, bt, sl, qsl)
    with pytest.raises(ValueError, match="q must have shape"):
        pb.paged_prefill(q[..., :32], k, v, bt, sl, qsl)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        pb.paged_prefill(q[None], k, v, bt, sl, qsl)
    with pytest.raises(ValueError, match="q heads"):
        pb.paged_prefill(q[:, :3], k, v, bt, sl, qsl)
    with pytest.raises(TypeError, match="seq_lens"):
        pb.paged_prefill(q, k, v, bt, sl.long(), qsl)
    with pytest.raises(ValueError, match="seq_lens"):
        pb.paged_prefill(q, k, v, bt, torch.tensor([9, 3 + 4 * bt.shape[1]], dtype=torch.int32), qsl)
    with pytest.raises(ValueError, match="block_table"):
        pb.paged_prefill(q, k, v, bt[:1], sl, qsl)
    with pytest.raises(TypeError, match="block_table"):
        pb.paged_prefill(q, k, v, bt.long(), sl, qsl)
    with pytest.raises(ValueError, match="v_cache"):
        pb.paged_prefill(q, k, v[:, :2], bt, sl, qsl)
    with pytest.raises(TypeError, match="causal"):
        pb.paged_prefill(q, k, v, bt, sl, qsl, causal=1)
    with pytest.raises(ValueError, match="scale"):
        pb.paged_prefill(q, k, v, bt, sl, qsl, scale=-1.0)


def test_kernel_name_and_sm90_switch(monkeypatch):
    """Off sm_90 GPUs (here: CPU) the Hopper kernel is never chosen, and ``PAGED_BACKEND_SM90=0``
    turns it off on them too."""
    from paged_backend.kernels import dispatch
    from paged_backend.prefill import prefill_kernel_name
    q, k, v, *_ = make_prefill_inputs([8], [8], 4, 2, 64, 16, F32)
    assert prefill_kernel_name(q, k, v) == ("portable" if INTERPRET else "torch")
    assert not dispatch.use_sm90(torch.device("cpu"))
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "triton_release", lambda: dispatch.SM90_TRITON[0])
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    cuda = torch.device("cuda", 0)
    assert dispatch.use_sm90(cuda)
    monkeypatch.setenv("PAGED_BACKEND_SM90", "0")
    assert not dispatch.use_sm90(cuda)
    monkeypatch.delenv("PAGED_BACKEND_SM90")
    monkeypatch.setattr(dispatch, "triton_release", lambda: "3.9")
    assert not dispatch.use_sm90(cuda)


# --- GPU: bf16, long sequences, the benchmark's shapes in miniature.

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("bs", [1, 16, 64, 256])
def test_gpu_long(bs, dtype):
    # a 3000-token chunk over 2000 cached tokens, a whole 1500-token prompt, decodes, an empty request
    check([3000, 1500, 1, 1, 0], [5000, 1500, 4097, 1, 77], 32, 8, 128, bs, dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("gqa", [(32, 32), (32, 8), (32, 1), (12, 4)])
def test_gpu_dims_and_groups(d, gqa):
    check([700, 1, 333], [1200, 1, 333], gqa[0], gqa[1], d, 16, BF16, device="cuda", layout="vllm")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_causal_flag_huge_logits(causal):
    check([513, 64, 1], [1000, 64, 3], 32, 8, 128, 16, BF16, causal=causal, device="cuda", q_scale=30.0)


@pytest.mark.gpu
@gpu
def test_gpu_q_len_one_equals_decode():
    q, k, v, bt, sl, qsl = make_prefill_inputs([1] * 7, [1, 15, 16, 17, 1000, 4096, 9000], 32, 8, 128, 16, BF16,
                                               device="cuda")
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl)
    dec_o, dec_lse = pb.paged_decode(q, k, v, bt, sl)
    assert_close_state(out, lse, dec_o, dec_lse.double(), BF16)
