"""Paged K/V for the Hopper (sm_90) kernels: TMA page loads into shared rings, the loader's hand-offs to its
consumers, the converter of fp8 tiles, the caches' TMA views and descriptors (kernels/attend_sm90.py attends).

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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from paged_backend.kernels.dispatch import q_tma, sm90_shape

# Registers a thread of the kernels with converter warps (fp8 caches): [the second consumer warpgroup, the loader
# warp, the two converter warps] (loader and converters share a warpgroup: equal; the first consumer warpgroup
# gets what is left of 512: 200). The converters turn a whole 64-key tile at once (64 values a thread in, as many
# out): at 48 registers, 16 rows at a time, the prefill over fp8 ran 1.13-1.14x slower (H200, 2026-11-30,
# results/sweeps/prefill_fp8_sm90_h200.log).
CONVERT_REGS = gl.constexpr([200, 112, 112])


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


@gluon.constexpr_function
def _tile_rows(rows, d, nbytes, warps, down):
    """``rows`` rows of ``d`` values of ``nbytes`` bytes, 16 bytes a thread, over ``warps`` warps; ``down``, for
    rows of 128 fp8 values: the threads go down the rows first. Eight threads along one such row (a phase of a
    16-byte access) write the same four 16-byte columns of both 128-byte swizzle spans of its 256-byte 16-bit
    row: 2-way bank conflicts (ncu of the fp8 decode, H200: its V conversion's stores took 8 wavefronts for 4).
    Eight rows of one column hit eight bank groups of either tile, whose swizzle moves the column by the row."""
    if not down or nbytes != 1 or d != 128:
        return gl.BlockedLayout([1, 16 // nbytes], [32 // (d * nbytes // 16), d * nbytes // 16], [warps, 1], [1, 0])
    rest = [[8 << i, 0] for i in range((rows // 8).bit_length() - 1)] + [[0, 64]]  # what the lanes do not cover
    nw = warps.bit_length() - 1
    return gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8]] + rest[nw:],
                                      [[1, 0], [2, 0], [4, 0], [0, 16], [0, 32]], rest[:nw], [], [rows, d])


@gluon.jit
def copy_tile(src, dst, n0, hi, ZERO: gl.constexpr, CHUNK: gl.constexpr = 0, DOWN: gl.constexpr = False):
    """A K/V tile ``src [BLOCK_N, D]`` of keys ``n0 ..`` -> ``dst`` in its dtype (fp8 -> 16-bit, exact; or in
    place), ``CHUNK`` rows at a time (0: all at once; fewer registers, more round trips); ``ZERO``: keys at or
    past ``hi`` become zeros (the last page's slots past a sequence may hold anything, NaN x 0 is NaN);
    ``DOWN``: the threads down the rows first (:func:`_tile_rows`)."""
    KEYS: gl.constexpr = src.shape[0]
    STEP: gl.constexpr = CHUNK if CHUNK else KEYS
    layout: gl.constexpr = _tile_rows(STEP, src.shape[1], src.dtype.primitive_bitwidth // 8, gl.num_warps(), DOWN)
    # Each chunk's store waits at a barrier for the one before (the compiler sees one buffer written twice), so
    # the next chunk is loaded before this one is stored: its load's latency is spent beside that wait.
    x = src.slice(0, STEP).load(layout)
    for r in gl.static_range(0, KEYS, STEP):
        if r + STEP < KEYS:
            nxt = src.slice(r + STEP, STEP).load(layout)
        y = x.to(dst.dtype)
        if ZERO:
            keys = n0 + r + gl.arange(0, STEP, layout=gl.SliceLayout(1, layout))
            y = gl.where(keys[:, None] < hi, y, gl.zeros_like(y))
        dst.slice(r, STEP).store(y)
        if r + STEP < KEYS:
            x = nxt
    fence_async_shared()


@gluon.jit
def _stage(ring, t):
    """Ring tile ``t``'s (stage, phase) in ``ring`` = (tiles [STAGES, ...], ready, empty)."""
    STAGES: gl.constexpr = ring[0].shape[0]
    return t % STAGES, (t // STAGES) & 1


@gluon.jit
def convert_tile(src, dst, t, CHUNK: gl.constexpr):
    """Ring tile ``t`` of an fp8 ring -> the 16-bit ring (``src``, ``dst``: (tiles, ready, empty), each with its
    own stages), ``CHUNK`` rows at a time (the whole tile: 0), once it has landed and its 16-bit stage is free;
    published to the consumers, and its fp8 stage released to the loader.
    Whole tiles go down the rows (``copy_tile``'s ``DOWN``, conflict-free stores): the prefill over fp8 1.08-1.10x
    (H200, same-call A/B, sweeps/prefill_fp8_sm90_h200.log section 4). Not in the fused node kernel's 8-row chunks
    (converters at 32 registers): the one A/B with it there had the decode's V copies (since gone) so too, and the
    tails' consumer spilled 4-8 bytes."""
    s8, phase8 = _stage(src, t)
    s, phase = _stage(dst, t)
    mbarrier.wait(src[1].index(s8), phase8)
    mbarrier.wait(dst[2].index(s), phase ^ 1)
    copy_tile(src[0].index(s8), dst[0].index(s), 0, 0, False, CHUNK, CHUNK == 0)
    gl.thread_barrier()  # every warp's stores (and their fence) before the arrival
    mbarrier.arrive(dst[1].index(s), count=1)
    mbarrier.arrive(src[2].index(s8), count=1)


@gluon.jit
def convert_range(k_rings, v_rings, it, n_tiles, CHUNK: gl.constexpr = 0):
    """A converter's part of one work item (warps beside the loader, for consumers whose wgmma takes no fp8
    operand with 16-bit queries): ``n_tiles >= 1`` K and V tiles from ring tile ``it``, fp8 -> fp16 (exact: one
    instruction for two values), in the order :func:`attend_tiles` reads them (tile ``j + 1``'s K before tile
    ``j``'s V). ``k_rings`` / ``v_rings``: ((fp8 tiles, ready, empty), (fp16 tiles, ready, empty)); the fp8 ring
    may have fewer stages than the fp16 one. ``CHUNK``: rows converted at a time (0: the whole tile, 64 values a
    thread in and as many out at 64 keys x 128: ``CONVERT_REGS``). -> the next ring index."""
    convert_tile(k_rings[0], k_rings[1], it, CHUNK)
    for j in range(n_tiles):
        if j + 1 < n_tiles:
            convert_tile(k_rings[0], k_rings[1], it + j + 1, CHUNK)
        convert_tile(v_rings[0], v_rings[1], it + j, CHUNK)
    return it + n_tiles


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
