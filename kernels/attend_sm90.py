"""Gluon building blocks of the Hopper (sm_90) kernels: attention of 64 query rows per warpgroup with
asynchronous wgmma (FA-3's pipeline; the prefill and the cascade node kernel) and decode-shaped "swapped"
attention (the decode kernel), over the K/V rings of kernels/ring_sm90.py (paged K/V through TMA).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from paged_backend.kernels.ring_sm90 import alloc_ring, copy_tile

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma's M per warpgroup)
CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program (registers: 2 x 128 threads at 240)


@gluon.constexpr_function
def mma_layout(n):
    """The accumulator layout of a ``[ROWS, n]`` wgmma on one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def soft_cap(s, qk_scale, cap, SOFTCAP: gl.constexpr):
    """Raw scores -> (scores, their scale to the exp2 domain): ``(s, qk_scale)``, or with ``SOFTCAP``
    ``(cap * tanh(s * qk_scale / cap), 1)``, the soft-capped scores in the exp2 domain (``cap = softcap *
    log2(e)``), with the hardware's ``tanh.approx`` as the portable kernels take it for half-precision
    inputs. (The tanh bounds the scores: a maximum is taken of the capped ones.)"""
    scale = qk_scale
    if SOFTCAP:
        s = cap * gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * (qk_scale / cap)],
                                            dtype=gl.float32, is_pure=True, pack=1)
        scale = 1.0
    return s, scale


@gluon.jit
def sink_scale(lse, sink):
    """-> (factor, lse'): a state's output factor ``exp(lse - lse')`` and its new lse once a key of logit
    ``sink`` and value 0 joins it (logaddexp, ``sink`` finite); an empty state (lse -inf) gives 0 and ``sink``."""
    new = gl.maximum(lse, sink) + gl.log(1.0 + gl.exp(-gl.abs(lse - sink)))
    return gl.exp(lse - new), new


@gluon.jit
def _softmax_tile(s_acc, m_i, l_i, qk_scale, cap, keys, pos, hi, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                  SOFTCAP: gl.constexpr):
    """Online-softmax update of one tile of raw scores ``s_acc [ROWS, BLOCK_N]`` (m, l in the exp2
    domain); ``MASKED``: keys at or past ``hi`` (and, ``CAUSAL``, past the row's position) are masked.
    The row maximum is taken of the raw scores and scaled once, so that each score costs one FMA
    before its exp2 (scaling every score first measured 4.5-5.4% slower at 240 registers, H100).
    ``SOFTCAP``: scores are soft-capped first (:func:`soft_cap`)."""
    s, scale = soft_cap(s_acc, qk_scale, cap, SOFTCAP)
    if MASKED:
        ok = keys[None, :] < hi
        if CAUSAL:
            ok = ok & (keys[None, :] <= pos[:, None])
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)  # scale > 0: the max commutes with it
    m_use = m_new
    if MASKED:  # a row without keys yet (only with lengths the API rejects) exponentiates against 0
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * scale - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_step(s_acc, m_i, l_i, qk_scale, cap, keys, pos, hi, n_full, j, CAUSAL: gl.constexpr,
                  SOFTCAP: gl.constexpr):
    """Tile ``j``: unmasked below ``n_full`` (every row sees all its keys), masked from there."""
    if j < n_full:
        p, alpha, m_i, l_i = _softmax_tile(s_acc, m_i, l_i, qk_scale, cap, keys, pos, hi, False, CAUSAL, SOFTCAP)
    else:
        p, alpha, m_i, l_i = _softmax_tile(s_acc, m_i, l_i, qk_scale, cap, keys, pos, hi, True, CAUSAL, SOFTCAP)
    return p, alpha, m_i, l_i


@gluon.jit
def _operand(p, dtype: gl.constexpr, layout: gl.constexpr, NOW: gl.constexpr):
    """The probabilities ``p`` as the ``P V`` GEMM's A operand (``dtype``, ``layout``) if ``NOW``, else as they are."""
    if NOW:
        p = gl.convert_layout(p.to(dtype), layout)
    return p


@gluon.jit
def attend_tiles(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles, n_full, n0, hi, pos,
                 qk_scale, cap, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 ZERO_TAIL: gl.constexpr, SOFTCAP: gl.constexpr, EARLY_P: gl.constexpr):
    """One warpgroup's ``ROWS`` query rows (``q_tile`` in shared memory) over ``n_tiles >= 1`` key
    tiles from key ``n0`` (ring tiles ``it ..``); tiles from ``n_full`` on are masked (keys ``>= hi``;
    ``CAUSAL``: past ``pos [ROWS]``). ``ZERO_TAIL``: the last tile's V rows at or past ``hi`` may
    hold anything (NaN x 0 is NaN) and are zeroed in shared memory first (every consumer writes the
    same zeros). ``SOFTCAP``: scores soft-capped (``cap = softcap * log2(e)``; see ``_softmax_tile``).
    ``EARLY_P``: each tile's P becomes the 16-bit GEMM operand right after its softmax, so 32 registers a
    thread, not 64 fp32, are live across the next tile's ``Q K^T`` (the prefill: its causal 128-key tiles
    spilled 264 bytes otherwise, and ran 1-9% slower; H200, sweeps/prefill_early_p_h200.log); else at its
    GEMM (the cascade node kernel: 8192/64/256 45.3 -> 55.9 us with it early).
    -> (acc [ROWS, D] fp32, m [ROWS], l [ROWS]) in the exp2 domain.

    FA-3's intra-warpgroup pipeline: ``S_j = Q K_j^T`` is issued before ``P_{j-1} V_{j-1}``, and the
    softmax of ``S_j`` runs while that GEMM is in flight."""
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_tile.dtype
    n_s = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    s = it % STAGES
    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
    s_acc = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False)
    mbarrier.arrive(k_empty.index(s), count=1)
    p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, cap, n_s, pos, hi, n_full, 0, CAUSAL, SOFTCAP)
    p = _operand(p, dtype, p_layout, EARLY_P)
    for j in range(1, n_tiles):
        s = (it + j) % STAGES
        sp = (it + j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), ((it + j) // STAGES) & 1)
        s_tok = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp), ((it + j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(_operand(p, dtype, p_layout, not EARLY_P), v_smem.index(sp), acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))  # wgmma groups complete in order
        mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, cap, n_s + j * BLOCK_N, pos, hi, n_full, j,
                                           CAUSAL, SOFTCAP)
        p = _operand(p, dtype, p_layout, EARLY_P)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    last = it + n_tiles - 1
    s = last % STAGES
    mbarrier.wait(v_ready.index(s), (last // STAGES) & 1)
    v_tile = v_smem.index(s)
    if ZERO_TAIL:
        n_last = n0 + (n_tiles - 1) * BLOCK_N
        if n_last + BLOCK_N > hi:
            v = v_tile.load(io_layout())
            keys = n_last + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout()))
            v_tile.store(gl.where(keys[:, None] < hi, v, gl.zeros_like(v)))
            fence_async_shared()
    acc = warpgroup_mma(_operand(p, dtype, p_layout, not EARLY_P), v_tile, acc)
    mbarrier.arrive(v_empty.index(s), count=1)
    return acc, m_i, l_i


@gluon.constexpr_function
def swapped_layout(nq):
    """The accumulator layout of a wgmma with ``nq`` columns (query heads) on one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nq, 16])


@gluon.jit
def fp16_operand(x):
    """Queries as the fp16 operands of GEMMs over an fp8 cache (``attend.mma_operand``): saturated to fp16's
    finite range (bf16 has more; fp16 holds bf16's 8 mantissa bits)."""
    return gl.minimum(gl.maximum(x.to(gl.float32), -65504.0), 65504.0).to(gl.float16)


@gluon.jit
def fp16_tile(q_tile):
    """A consumer's queries ``q_tile [ROWS, D]`` as fp16 operands, in place (:func:`fp16_operand`; fp16 ones as
    they are). -> the fp16 view of the tile."""
    if q_tile.dtype == gl.float16:
        return q_tile
    q = q_tile.load(io_layout())
    q16 = q_tile._reinterpret(gl.float16, q_tile.shape, q_tile.layout)  # (each thread rewrites what it read)
    q16.store(fp16_operand(q))
    fence_async_shared()
    return q16


@gluon.constexpr_function
def _v8_layout(n, d):
    """An fp8 V tile ``[n keys, d]`` as its registers come to be wgmma's A (V^T, :func:`attend_swapped`):
    a thread reads 2 (d 64) or 4 (d 128) contiguous head-dim bytes of each of its 16 keys, lanes taking keys
    as the A layout has them (no bank conflicts: tests/test_kernels_compile.py). The head dims' order in it is
    :func:`v_rows`'s."""
    nb = d // 64
    reg = [[0, 1 << i] for i in range(nb)] + [[1, 0], [8, 0], [16, 0], [32, 0]]
    lane = [[2, 0], [4, 0]] + [[0, (2 * nb) << i] for i in range(3)]
    warp = [[0, 16 * nb], [0, 32 * nb]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [n, d])


@gluon.constexpr_function
def _v_relabel(d, n):
    """(shape, order) of the reshape and permute that relabel V^T ``[d, n]`` loaded in :func:`_v8_layout` into
    wgmma's A rows (row ``r`` of the result is head dim :func:`v_rows` ``(r)``)."""
    if d == 128:
        return (2, ) * 7 + (n, ), (5, 0, 1, 6, 2, 3, 4, 7)
    return (2, ) * 6 + (n, ), (0, 1, 5, 2, 3, 4, 6)


@gluon.jit
def _v8_operand(v_tile, n0, hi, masked, a_layout: gl.constexpr):
    """An fp8 V tile ``[BLOCK_N, D]`` of keys ``n0 ..`` -> V^T ``[D, BLOCK_N]`` fp16 in wgmma's A layout, keys
    from ``hi`` on zeroed when ``masked``, its rows the head dims in :func:`v_rows`'s order: wgmma's
    row ``g + 8h + 16w (+ 64b)`` of thread (warp w, lane g) relabelled (:func:`_v_relabel`) so that a
    thread's rows are contiguous bytes of V (:func:`_v8_layout`) - a register-only relabel, checked."""
    BLOCK_N: gl.constexpr = v_tile.shape[0]
    D: gl.constexpr = v_tile.shape[1]
    layout: gl.constexpr = _v8_layout(BLOCK_N, D)
    v = v_tile.load(layout).to(gl.float16)  # [BLOCK_N, D], e4m3 -> fp16 exactly
    if masked:
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        v = gl.where(keys[:, None] < hi, v, gl.zeros_like(v))
    RELABEL: gl.constexpr = _v_relabel(D, BLOCK_N)
    vt = gl.permute(gl.reshape(gl.permute(v, (1, 0)), RELABEL[0]), RELABEL[1])  # [2, .., 2, BLOCK_N]
    return gl.convert_layout(gl.reshape(vt, [D, BLOCK_N]), a_layout, assert_trivial=True)


@gluon.jit
def v_rows(r, D: gl.constexpr):
    """The head dim of row ``r`` of :func:`_v8_operand` (and so of the output over an fp8 cache)."""
    NB: gl.constexpr = D // 64
    return ((r >> 3) & 1) + 2 * ((r >> 6) & 1) + 2 * NB * (r & 7) + 16 * NB * ((r >> 4) & 3)


@gluon.jit
def attend_swapped(q_smem, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles, n_full, n0,
                   hi, qk_scale, cap, D: gl.constexpr, NQ: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   SOFTCAP: gl.constexpr):
    """Decode-shaped attention, "swapped" (kernels/decode_sm90.py): the warpgroup's ``NQ`` query heads
    (``q_smem [NQ, D]``, wgmma's N) over ``n_tiles >= 1`` ring tiles ``it ..`` of keys ``n0 ..`` (wgmma's
    M), ``S^T = K Q^T`` and ``O^T += V^T P^T`` (``p_smem [NQ, BLOCK_N]``); tiles from ``n_full`` on are
    masked at ``hi``; the warpgroup releases each stage it reads (one arrival). ``SOFTCAP``: the scores
    soft-capped first (:func:`soft_cap`, ``cap = softcap * log2(e)``).
    -> (acc [D, NQ] fp32, m [NQ], l [NQ]) in the exp2 domain.
    An fp8 cache's K and V are converted in registers, V^T's rows the head dims in :func:`v_rows`'s order
    (so acc's too); a 16-bit cache's tiles are the GEMMs' operands as they are (a masked tile's V rows
    past ``hi`` zeroed in place)."""
    F8: gl.constexpr = k_smem.dtype.is_fp8()
    s_layout: gl.constexpr = swapped_layout(NQ)
    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_acc = gl.zeros([BLOCK_N, NQ], gl.float32, layout=s_layout)  # summed over keys once, at the end
    acc = gl.zeros([D, NQ], gl.float32, layout=s_layout)
    zero_s = gl.zeros([BLOCK_N, NQ], gl.float32, layout=s_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    for j in range(n_tiles):
        s = (it + j) % STAGES
        phase = ((it + j) // STAGES) & 1
        masked = j >= n_full
        mbarrier.wait(k_ready.index(s), phase)
        if F8:
            k = k_smem.index(s).load(a_layout).to(gl.float16)  # wgmma's A from registers: no fp16 copy of K
            s_tok = warpgroup_mma(k, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            # released after the GEMM's issue, which waits for its registers: every load of the stage has read it
            # (an arrive does not wait for loads in flight; decode_sm90.consumer's queries raced so)
            mbarrier.arrive(k_empty.index(s), count=1)
        else:
            s_tok = warpgroup_mma(k_smem.index(s), q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(s), phase)
        if not F8:
            v_tile = v_smem.index(s)
            if masked:  # (beside the scores' GEMM)
                copy_tile(v_tile, v_tile, n0 + j * BLOCK_N, hi, True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        if F8:
            # V^T as wgmma's A from registers, like K (no fp16 tile in shared memory, no copy, fence or barrier);
            # loaded after the scores' wait: before it K's registers are still in flight and the loads spill
            vt = _v8_operand(v_smem.index(s), n0 + j * BLOCK_N, hi, masked, a_layout)
        else:
            mbarrier.arrive(k_empty.index(s), count=1)
        sc, scale = soft_cap(sc, qk_scale, cap, SOFTCAP)
        if masked:
            keys = n0 + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
            sc = gl.where(keys[:, None] < hi, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 0) * scale)  # scale > 0: the max commutes with it
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exponentiate against 0
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc * scale - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        p_smem.store(gl.permute(p.to(p_smem.dtype), (1, 0)))
        fence_async_shared()
        if F8:
            acc = warpgroup_mma(vt, p_smem.permute((1, 0)), acc * alpha[None, :])
        else:
            acc = warpgroup_mma(v_tile.permute((1, 0)), p_smem.permute((1, 0)), acc * alpha[None, :])
        mbarrier.arrive(v_empty.index(s), count=1)
    return acc, m_i, gl.sum(l_acc, 0)


@gluon.jit
def finish_swapped(acc, m_i, l_i, v_scale):
    """:func:`attend_swapped`'s (acc [D, NQ], m, l) in the exp2 domain -> (o [D, NQ] fp32 times
    ``v_scale``, lse [NQ] natural log); heads that saw no key give o = 0, lse = -inf."""
    empty = l_i == 0.0
    o = acc * (v_scale / gl.where(empty, 1.0, l_i))[None, :]
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


@gluon.jit
def alloc_rings(k_desc, v_desc, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Shared memory of a program: Q tiles (one per consumer), the K and V rings and their
    barriers (:func:`alloc_ring`: every consumer releases a stage).
    -> (q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty)."""
    dtype: gl.constexpr = k_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, D], gl.NVMMASharedLayout.get_default_for([ROWS, D],
                                                                                                      dtype))
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_ring(k_desc, v_desc, BLOCK_N, STAGES, CONSUMERS)
    return q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def finish_state(acc, m_i, l_i):
    """(acc, m, l) in the exp2 domain -> (o [ROWS, D] fp32, lse [ROWS] natural log); rows that saw
    no key give o = 0, lse = -inf."""
    empty = l_i == 0.0
    o = acc / gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, acc.type.layout))[:, None]
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


@gluon.jit
def load_rows(q_tile, q_ptr, q_row, qh, ok, stride_qt, stride_qh, D: gl.constexpr):
    """Query rows ``q_row [ROWS]`` (int64), heads ``qh [ROWS]`` -> ``q_tile`` (wgmma's A operand; an fp16 tile takes
    bf16 queries as :func:`fp16_operand`); rows not ``ok`` are zeros. The index vectors are in
    :func:`io_layout`'s row slice."""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, io_layout()))
    q = gl.load(q_ptr + q_row[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :], mask=ok[:, None], other=0.0)
    if q_tile.dtype == q.dtype:
        q_tile.store(q)
    else:  # an fp16 tile of 16-bit queries over an fp8 cache
        q_tile.store(fp16_operand(q))
    fence_async_shared()


@gluon.constexpr_function
def io_layout():
    """Rows of 16-bit values, 16 bytes a thread, over one warpgroup (loads and stores of ``[ROWS, D]``)."""
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
