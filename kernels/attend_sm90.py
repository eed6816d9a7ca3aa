"""Gluon building blocks of the Hopper (sm_90) kernels: paged K/V through TMA, attention of 64 query
rows per warpgroup with asynchronous wgmma.

Pages: the caches are read through 2-D TMA descriptors over their storage, ``[rows, width]`` with
row stride ``stride_ks``; key ``n`` of KV head ``h`` of page ``p`` is row ``p * PAGE_ROWS + h *
HEAD_ROWS + n % BS``, column ``h * HEAD_COLS`` (NHD caches: ``HEAD_ROWS = 0``; HND caches:
``HEAD_COLS = 0``). A tile of ``BLOCK_N`` keys is ``BLOCK_N // PAGE_BOX`` boxes, one per page (or
page part). Boxes at or past a bound ``hi`` are loaded from row ``rows`` (out of bounds: TMA fills
zeros), so no block-table entry past it is used.

Rings: K and V tiles live in ``STAGES``-deep shared rings with a ``ready`` mbarrier per stage
(TMA completes it) and an ``empty`` one (each consumer warpgroup arrives once it has read the stage).
A kernel's loader and consumers count tiles with one running index ``it`` (stage ``it % STAGES``,
phase ``(it // STAGES) & 1``), across all the work items a persistent program walks.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from paged_backend.kernels.dispatch import q_tma, sm90_shape

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma's M per warpgroup)
CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program (registers: 2 x 128 threads at 240)
# Registers a thread of the kernels with converter warps (fp8 caches): [the second consumer warpgroup, the loader
# warp, the two converter warps] (loader and converters share a warpgroup: equal; the first consumer warpgroup
# gets what is left of 512: 200). The converters turn a whole 64-key tile at once (64 values a thread in, as many
# out): at 48 registers, 16 rows at a time, the prefill over fp8 ran 1.13-1.14x slower (H200, 2026-11-30,
# results/sweeps/prefill_fp8_sm90_h200.log).
CONVERT_REGS = gl.constexpr([200, 112, 112])


@gluon.constexpr_function
def mma_layout(n):
    """The accumulator layout of a ``[ROWS, n]`` wgmma on one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _box_row(bt_row_ptr, stride_btn, n, hi, kvh, page_rows, head_rows, oob_row, BS: gl.constexpr):
    """TMA row of the page box starting at key ``n``; boxes at or past ``hi`` read out of bounds."""
    page = gl.load(bt_row_ptr + (n // BS) * stride_btn, mask=n < hi, other=0)
    return gl.where(n < hi, page * page_rows + kvh * head_rows + n % BS, oob_row)


@gluon.jit
def load_tile(desc, smem, ready, empty, free, bt_row_ptr, stride_btn, n0, hi, kvh, col, page_rows, head_rows,
              oob_row, BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` of one cache into ``smem`` once the stage is free (phase
    ``free``): one TMA box per page."""
    mbarrier.wait(empty, free)
    mbarrier.expect(ready, BLOCK_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8)
    for i in gl.static_range(BLOCK_N // PAGE_BOX):
        row = _box_row(bt_row_ptr, stride_btn, n0 + i * PAGE_BOX, hi, kvh, page_rows, head_rows, oob_row, BS)
        tma.async_copy_global_to_shared(desc, [row, col], ready, smem.slice(i * PAGE_BOX, PAGE_BOX))


@gluon.jit
def _ring_tile(desc, smem, ready, empty, t, bt_row_ptr, stride_btn, n0, hi, kvh, col, page_rows, head_rows, oob_row,
               BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr, STAGES: gl.constexpr):
    """Ring tile ``t`` (keys ``n0 ..``) of one cache, once its stage is free (a fresh barrier passes phase 1)."""
    s = t % STAGES
    load_tile(desc, smem.index(s), ready.index(s), empty.index(s), ((t // STAGES) & 1) ^ 1, bt_row_ptr, stride_btn,
              n0, hi, kvh, col, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX)


@gluon.jit
def load_range(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles, bt_row_ptr,
               stride_btn, n0, hi, kvh, col, page_rows, head_rows, oob_row,
               BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr, STAGES: gl.constexpr,
               K_AHEAD: gl.constexpr = False):
    """The loader's part of one work item: ``n_tiles`` K and V tiles from key ``n0``, ring tiles
    ``it ..``. -> the next ring index. ``K_AHEAD``: tile ``j + 1``'s K is issued before tile ``j``'s V,
    for consumers that use K a tile before V (:func:`attend_tiles`: ``Q K_j^T`` beside ``P_{j-1} V_{j-1}``),
    so that a K stage waits only for the K stage before it to be read, not for a V stage as well (H200 prefill:
    1-5% faster; ``n_tiles >= 1``)."""
    if K_AHEAD:
        _ring_tile(k_desc, k_smem, k_ready, k_empty, it, bt_row_ptr, stride_btn, n0, hi, kvh, col, page_rows,
                   head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)
    for j in range(n_tiles):
        if K_AHEAD:
            if j + 1 < n_tiles:
                _ring_tile(k_desc, k_smem, k_ready, k_empty, it + j + 1, bt_row_ptr, stride_btn, n0 + (j + 1) * BLOCK_N,
                           hi, kvh, col, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)
        else:
            _ring_tile(k_desc, k_smem, k_ready, k_empty, it + j, bt_row_ptr, stride_btn, n0 + j * BLOCK_N, hi, kvh,
                       col, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)
        _ring_tile(v_desc, v_smem, v_ready, v_empty, it + j, bt_row_ptr, stride_btn, n0 + j * BLOCK_N, hi, kvh, col,
                   page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)
    return it + n_tiles


@gluon.jit
def release_tiles(k_ready, v_ready, k_empty, v_empty, it, n_tiles, STAGES: gl.constexpr):
    """A consumer's part of a work item it has no rows in: ring tiles ``it ..`` released as they
    arrive (waiting for each keeps its release in that tile's phase of the ``empty`` barrier)."""
    for j in range(n_tiles):
        s = (it + j) % STAGES
        phase = ((it + j) // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.wait(v_ready.index(s), phase)
        mbarrier.arrive(v_empty.index(s), count=1)


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


@gluon.constexpr_function
def _tile_rows(d, nbytes, warps=4):
    """Rows of ``d`` values of ``nbytes`` bytes, 16 bytes a thread, over ``warps`` warps (one warpgroup)."""
    return gl.BlockedLayout([1, 16 // nbytes], [32 // (d * nbytes // 16), d * nbytes // 16], [warps, 1], [1, 0])


@gluon.jit
def copy_tile(src, dst, n0, hi, ZERO: gl.constexpr):
    """A K/V tile ``src [BLOCK_N, D]`` of keys ``n0 ..`` -> ``dst`` in its dtype (fp8 -> 16-bit, exact; or in
    place); ``ZERO``: keys at or past ``hi`` become zeros (the last page's slots past a sequence may hold
    anything, NaN x 0 is NaN)."""
    layout: gl.constexpr = _tile_rows(src.shape[1], src.dtype.primitive_bitwidth // 8, gl.num_warps())
    x = src.load(layout).to(dst.dtype)
    if ZERO:
        keys = n0 + gl.arange(0, src.shape[0], layout=gl.SliceLayout(1, layout))
        x = gl.where(keys[:, None] < hi, x, gl.zeros_like(x))
    dst.store(x)
    fence_async_shared()


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


@gluon.jit
def convert_tile(src, dst, t, STAGES: gl.constexpr):
    """Ring tile ``t`` of an fp8 ring -> the 16-bit ring (``src``, ``dst``: (tiles, ready, empty)), once it has
    landed and its 16-bit stage is free; published to the consumers, and its fp8 stage released to the loader."""
    s = t % STAGES
    phase = (t // STAGES) & 1
    mbarrier.wait(src[1].index(s), phase)
    mbarrier.wait(dst[2].index(s), phase ^ 1)
    copy_tile(src[0].index(s), dst[0].index(s), 0, 0, False)  # the whole tile at once (CONVERT_REGS)
    gl.thread_barrier()  # every warp's stores (and their fence) before the arrival
    mbarrier.arrive(dst[1].index(s), count=1)
    mbarrier.arrive(src[2].index(s), count=1)


@gluon.jit
def convert_range(k_rings, v_rings, it, n_tiles, STAGES: gl.constexpr):
    """A converter's part of one work item (warps beside the loader, for consumers whose wgmma takes no fp8
    operand with 16-bit queries): ``n_tiles >= 1`` K and V tiles from ring tile ``it``, fp8 -> fp16 (exact: one
    instruction for two values), in the order :func:`attend_tiles` reads them (tile ``j + 1``'s K before tile
    ``j``'s V). ``k_rings`` / ``v_rings``: ((fp8 tiles, ready, empty), (fp16 tiles, ready, empty)).
    -> the next ring index."""
    convert_tile(k_rings[0], k_rings[1], it, STAGES)
    for j in range(n_tiles):
        if j + 1 < n_tiles:
            convert_tile(k_rings[0], k_rings[1], it + j + 1, STAGES)
        convert_tile(v_rings[0], v_rings[1], it + j, STAGES)
    return it + n_tiles


@gluon.jit
def attend_swapped(q_smem, k_smem, v_smem, v16, p_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles, n_full, n0,
                   hi, qk_scale, cap, D: gl.constexpr, NQ: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   SOFTCAP: gl.constexpr):
    """Decode-shaped attention, "swapped" (kernels/decode_sm90.py): the warpgroup's ``NQ`` query heads
    (``q_smem [NQ, D]``, wgmma's N) over ``n_tiles >= 1`` ring tiles ``it ..`` of keys ``n0 ..`` (wgmma's
    M), ``S^T = K Q^T`` and ``O^T += V^T P^T`` (``p_smem [NQ, BLOCK_N]``); tiles from ``n_full`` on are
    masked at ``hi``; the warpgroup releases each stage it reads (one arrival). ``SOFTCAP``: the scores
    soft-capped first (:func:`soft_cap`, ``cap = softcap * log2(e)``).
    -> (acc [D, NQ] fp32, m [NQ], l [NQ]) in the exp2 domain.
    An fp8 cache's K is converted in registers and its V into ``v16``; a 16-bit cache's tiles are
    the GEMMs' operands as they are (a masked tile's V rows past ``hi`` zeroed in place)."""
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
            mbarrier.arrive(k_empty.index(s), count=1)
            s_tok = warpgroup_mma(k, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        else:
            s_tok = warpgroup_mma(k_smem.index(s), q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(s), phase)  # V's conversion runs beside the scores' GEMM
        if F8:
            v_tile = v16
            if masked:
                copy_tile(v_smem.index(s), v16, n0 + j * BLOCK_N, hi, True)
            else:
                copy_tile(v_smem.index(s), v16, n0, hi, False)
            mbarrier.arrive(v_empty.index(s), count=1)
        else:
            v_tile = v_smem.index(s)
            if masked:
                copy_tile(v_tile, v_tile, n0 + j * BLOCK_N, hi, True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        if not F8:
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
        acc = warpgroup_mma(v_tile.permute((1, 0)), p_smem.permute((1, 0)), acc * alpha[None, :])
        if not F8:
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
def alloc_ring(k_desc, v_desc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS_: gl.constexpr):
    """The K and V rings of a program (the caches' dtype and tile layouts) and their barriers, a stage
    released once each of ``CONSUMERS_`` warpgroups has read it.
    -> (k_smem, v_smem, k_ready, v_ready, k_empty, v_empty)."""
    dtype: gl.constexpr = k_desc.dtype
    layout: gl.constexpr = k_desc.layout
    D: gl.constexpr = k_desc.block_type.shape[1]
    return alloc_ring_of(dtype, layout, BLOCK_N, D, STAGES, CONSUMERS_)


@gluon.jit
def alloc_ring_of(dtype: gl.constexpr, layout: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMERS_: gl.constexpr):
    """:func:`alloc_ring` of ``[BLOCK_N, D]`` tiles of ``dtype`` in shared ``layout``."""
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS_)
        mbarrier.init(v_empty.index(s), count=CONSUMERS_)
    return k_smem, v_smem, k_ready, v_ready, k_empty, v_empty


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
def uniform(x):
    """``x``, the same in every lane, as a broadcast from lane 0 (what Triton does for warp ids), so that ptxas
    knows it is: a reduction's or a shared-memory load's result is not to it, and then everything derived from
    it (a request's rows and lengths, page loads, TMA coordinates, loop bounds) runs in vector registers, with an
    R2UR before every TMA and wgmma operand and a divergence check on every branch - 45% more code, and the
    persistent prefill 20-25% slower than one program a tile (sweeps/prefill_persistent_h200.log)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, -1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=True, pack=1)


FIELDS = gl.constexpr(8)  # a work item as a loader hands it to its consumers: int32 fields, the 7th its tiles


@gluon.constexpr_function
def _slot_layout(num_warps):
    """A slot's fields all in each thread: one thread stores them (the one that then arrives on the barrier
    that publishes them), and every thread reads its fields without shuffles."""
    return gl.BlockedLayout([FIELDS], [32], [num_warps], [0])


@gluon.jit
def hand(slots, k_ready, k_empty, it, fields, STAGES: gl.constexpr):
    """The loader: an item's ``FIELDS`` ``fields`` to the consumers at ring tile ``it`` (the item's first K
    tile), in that stage's slot (``slots [STAGES, FIELDS]`` int32) once the stage is free (the consumers read
    the slot before they release it). The TMA completing the tile's ``k_ready`` barrier publishes the slot."""
    s = it % STAGES
    mbarrier.wait(k_empty.index(s), ((it // STAGES) & 1) ^ 1)
    layout: gl.constexpr = _slot_layout(gl.num_warps())
    k = gl.arange(0, FIELDS, layout=layout)
    v = gl.zeros([FIELDS], gl.int32, layout)
    for j in gl.static_range(FIELDS):
        v = gl.where(k == j, fields[j], v)
    slots.index(s).store(v)


@gluon.jit
def hand_end(slots, k_ready, k_empty, it, STAGES: gl.constexpr):
    """The loader: no more items (fields of zeros: no tiles), published by arriving on ``k_ready`` itself (once
    every warp of the caller has stored them)."""
    hand(slots, k_ready, k_empty, it, (0, 0, 0, 0, 0, 0, 0, 0), STAGES)
    gl.thread_barrier()
    mbarrier.arrive(k_ready.index(it % STAGES), count=1)


@gluon.jit
def _field(v, k, j: gl.constexpr):
    return uniform(gl.sum(gl.where(k == j, v, 0), 0))


@gluon.jit
def handed(slots, k_ready, it, STAGES: gl.constexpr):
    """A consumer: the ``FIELDS`` fields of the item the loader handed at ring tile ``it`` (no tiles: no more)."""
    s = it % STAGES
    mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
    layout: gl.constexpr = _slot_layout(gl.num_warps())
    v = slots.index(s).load(layout)
    k = gl.arange(0, FIELDS, layout=layout)
    return (_field(v, k, 0), _field(v, k, 1), _field(v, k, 2), _field(v, k, 3), _field(v, k, 4), _field(v, k, 5),
            _field(v, k, 6), _field(v, k, 7))


@gluon.jit
def load_q(q_load, n, coord):
    """The loader: the ``n``-th item's query box at ``coord`` (``q_desc``'s box: a consumer's rows) into each
    consumer's tile of Q buffer ``n % 2`` (``q_smem [2 * consumers, rows, D]``), once the consumers are done with
    the item before (``q_empty``); the box's rows past the queries are zeros. ``coord``: the first consumer's
    box; the next consumers' follow along the first dimension."""
    q_desc, q_smem, q_ready, q_empty = q_load
    BOX: gl.constexpr = q_desc.block_type.shape
    CONS: gl.constexpr = q_smem.shape[0] // 2
    j = n % 2
    mbarrier.wait(q_empty.index(j), ((n // 2) & 1) ^ 1)
    mbarrier.expect(q_ready.index(j), CONS * BOX[0] * BOX[1] * BOX[2] * q_desc.dtype.primitive_bitwidth // 8)
    for w in gl.static_range(CONS):
        tile = q_smem.index(j * CONS + w)._reinterpret(q_desc.dtype, BOX, q_desc.layout)
        tma.async_copy_global_to_shared(q_desc, [coord[0] + w * BOX[0], coord[1], coord[2]], q_ready.index(j),
                                        tile)


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


def page_view(cache: torch.Tensor):
    """``(rows, width, page_rows, head_rows, head_cols)`` of the 2-D TMA view of a cache
    ``[NB, BS, Hkv, D]``, or None when its strides do not allow one (see the module doc)."""
    nb, bs, hkv, d = cache.shape
    sb, ss, sh, sd = cache.stride()
    esize = cache.element_size()
    if sd != 1 or ss <= 0 or sb % ss or (ss * esize) % 16 or cache.data_ptr() % 16:
        return None
    if sh % ss == 0 and sh >= bs * ss:  # HND: a head's slots are rows of their own
        head_rows, head_cols, width = sh // ss, 0, d
    elif sh >= d and (hkv - 1) * sh + d <= ss:  # NHD: heads side by side in a slot's row
        head_rows, head_cols, width = 0, sh, ss
    else:
        return None
    page_rows = sb // ss
    rows = (nb - 1) * page_rows + (hkv - 1) * head_rows + bs
    return rows, width, page_rows, head_rows, head_cols


def covered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fp8: bool = False):
    """The TMA views of ``(k_cache, v_cache)`` when the sm_90 kernels cover these inputs, else None:
    fp16/bf16 queries over a cache of the same dtype (``fp8``: over an fp8 cache, either format), head
    size 64 or 128, pages of 16+ tokens (a power of two), query heads per KV head a power of two up
    to 64, strides :func:`page_view` takes."""
    cache_ok = k_cache.element_size() == 1 if fp8 else k_cache.dtype == q.dtype
    if q.dtype not in (torch.float16, torch.bfloat16) or not cache_ok or v_cache.dtype != k_cache.dtype:
        return None
    hq, d = q.shape[-2:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    if not sm90_shape(d, bs, hq // hkv) or bs & (bs - 1) or q.stride(-1) != 1:
        return None
    views = page_view(k_cache), page_view(v_cache)
    if None in views or views[0] != views[1]:
        return None
    return views[0]


def descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, view, box: int, block_n: int):
    """TMA descriptors of the two caches' views (:func:`page_view`), ``[box, D]`` boxes landing in
    ``[block_n, D]`` shared tiles."""
    rows, width = view[:2]
    d = k_cache.shape[-1]
    layout = shared_layout((block_n, d), k_cache.dtype)
    return [TensorDescriptor(c, [rows, width], [c.stride(1), 1], [box, d], layout) for c in (k_cache, v_cache)]


def q_descriptor(q: torch.Tensor, block: tuple):
    """A TMA descriptor of the queries ``[T, Hq, D]`` in ``block`` boxes, or None where :func:`q_tma` says no."""
    if not q_tma(q):
        return None
    return TensorDescriptor(q, list(q.shape), list(q.stride()), list(block), shared_layout(block, q.dtype))


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv,
              torch.float8_e5m2: gl.float8e5}


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple, dtype: torch.dtype):
    """The shared layout of a TMA box / wgmma tile of shape ``block`` and a tensor's dtype (made once: ~15 us
    of host time a call otherwise)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])
