"""Paged prefill for Hopper (sm_90): TMA page loads, asynchronous wgmma, warp specialisation.

Same contract as :mod:`paged_backend.kernels.prefill` (rows, causal alignment, natural-log LSE,
the tile list without a host sync), written in Gluon so that the kernel controls what Triton's
compiler does not let a ``tl.dot`` kernel control (FlashAttention-3's structure):

- persistent programs, one an SM, over work items (a tile of ``TOK`` query tokens x one KV head):
  each program's **loader** warp claims items from a counter (greedy, a causal request's heaviest
  tiles first: a program that finishes early takes more, as the hardware would schedule one program
  an item, without a program's start-up and end each time), hands each item's fields to the consumers through a shared
  slot, and streams its K/V pages with TMA into a ring of ``STAGES`` shared tiles (``BLOCK_N`` keys
  = ``BLOCK_N // PAGE_BOX`` page boxes each), signalling ``k_ready`` / ``v_ready`` mbarriers; it
  refills a K (V) stage once both consumers' GEMMs read it (``k_empty``, ``v_empty``), running
  ahead into the next item while the consumers finish one;
- two **consumer** warpgroups own 64 query rows each (``TOK`` tokens x ``GROUP`` heads of one KV
  head) and run ``S = Q K^T`` and ``O += P V`` on the tensor cores (wgmma: Q and K, V from shared
  memory, P from registers). Within a warpgroup, tile ``j``'s ``Q K^T`` is issued before tile
  ``j-1``'s ``P V``, and tile ``j``'s softmax runs while that GEMM is in flight (FA-3's
  intra-warpgroup pipelining). The two warpgroups run unsynchronised: a ping-pong schedule making
  them take turns at the tensor cores measured no better (docs/prefill.md).

Over an fp8 cache, two **converter** warps (beside the loader warp, in its warpgroup) turn each fp8 tile the
loader lands (a ring of its own) into an fp16 tile of the consumers' ring; the GEMMs run on fp16 operands as the
portable kernel's do. Tiles of 64 keys then: both rings and the queries' buffers fit in 208 KB.

Pages are read as kernels/ring_sm90.py describes; boxes past the request's length load zeros,
so no block-table entry past it is used. Slots past the length inside its last page may hold
anything (NaN): scores there are masked, and the consumers zero those rows of the V tile before
``P V`` (NaN x 0 is NaN).

Deterministic: every row's keys are folded in one fixed order. :func:`sm90_config` checks the subset
this kernel covers; everything else runs the portable kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from paged_backend.kernels.attend import LOG2E
from paged_backend.kernels.attend_sm90 import (CONSUMERS, ROWS, attend_tiles, finish_state, fp16_tile, io_layout,
                                               load_rows, mma_layout, sink_scale)
from paged_backend.kernels.ring_sm90 import (CONVERT_REGS, FIELDS, alloc_ring, alloc_ring_of, convert_range, covered,
                                             descriptors, hand, hand_end, handed, load_q, load_range, q_descriptor,
                                             uniform)
from paged_backend.kernels.dispatch import num_sms
from paged_backend.kernels.launch import launch, pow2


@gluon.jit
def _find_tile(qsl_ptr, stride_qsl, batch, pid, TOK: gl.constexpr, BLOCK_B: gl.constexpr,
               num_warps: gl.constexpr):
    """The program's request ``b``: the number of b in [0, B] with ``qsl[b] // TOK + b <= pid``,
    minus one (as in the portable kernel; ``qsl`` read with its stride)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs_b = gl.arange(0, BLOCK_B, layout=layout)
    cnt = gl.zeros([BLOCK_B], gl.int32, layout=layout)
    for b0 in range(0, batch + 1, BLOCK_B):
        ib = b0 + offs_b
        start = gl.load(qsl_ptr + ib.to(gl.int64) * stride_qsl, mask=ib <= batch, other=0)
        cnt += ((start // TOK + ib <= pid) & (ib <= batch)).to(gl.int32)
    return uniform(gl.sum(cnt, 0) - 1)


@gluon.jit
def _item(meta, i, HKV: gl.constexpr, TOK: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr,
          CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """Work item ``i`` (query tile ``i // Hkv`` of the requests' tiles laid end to end, KV head ``i % Hkv``)
    -> (live, b, kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full); items past a request's
    tiles are not live. A causal request's heaviest tiles come first."""
    qsl_ptr, seq_lens_ptr, stride_qsl, stride_sl, batch, max_tokens = meta
    x = i // HKV
    kvh = i % HKV
    b = _find_tile(qsl_ptr, stride_qsl, batch, x, TOK, BLOCK_B, num_warps)
    b64 = b.to(gl.int64)  # the metadata vectors are read with their strides (any views of wider buffers)
    q_begin = gl.load(qsl_ptr + b64 * stride_qsl)
    q_len = gl.load(qsl_ptr + (b64 + 1) * stride_qsl) - q_begin
    n_q = gl.cdiv(q_len, TOK)
    local = x - (q_begin // TOK + b)
    live = local < n_q
    if CAUSAL:
        local = n_q - 1 - local  # heaviest tiles of a request first
    seq_len = gl.minimum(gl.load(seq_lens_ptr + b64 * stride_sl, mask=live, other=0), max_tokens)
    off = gl.maximum(seq_len - q_len, 0)
    t0 = local * TOK
    if CAUSAL:
        hi = gl.minimum(off + gl.minimum(t0 + TOK, q_len), seq_len)
        n_full = (off + t0 + 1) // BLOCK_N  # tiles every row sees whole, all below the length
    else:
        hi = seq_len
        n_full = seq_len // BLOCK_N
    n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)  # one tile even without keys: nobody waits forever
    n_full = gl.minimum(n_full, seq_len // BLOCK_N)
    return live, b64, kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full


@gluon.jit
def _load_partition(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, slots, bt_ptr, meta,
                    counter_ptr, stride_btb, stride_btn, n_items, page_rows, head_rows, head_cols, oob_row, q_load,
                    TOK: gl.constexpr, BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr,
                    STAGES: gl.constexpr, BLOCK_B: gl.constexpr, CAUSAL: gl.constexpr, HKV: gl.constexpr,
                    Q_TMA: gl.constexpr):
    """One warp: each item's K/V tiles into the rings, running ahead across items. A program's first item is
    the one of its id; each next one it claims from ``counter`` once the last one's loads are issued, so that
    programs finishing early take more (greedy, heaviest items first), and hands its id to the consumers."""
    it = gl.to_tensor(0)
    n = gl.to_tensor(0)  # live items so far (Q buffer n % 2)
    i = gl.program_id(0)
    while i < n_items:
        live, b, kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full = _item(meta, i, HKV, TOK, BLOCK_N, BLOCK_B,
                                                                                CAUSAL, 1)
        if live:
            if Q_TMA:
                GROUP: gl.constexpr = q_load[0].block_type.shape[1]
                load_q(q_load, n, (q_begin + t0, kvh * GROUP, 0))
                n += 1
            hand(slots, k_ready, k_empty, it, (kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full), STAGES)
            it = load_range(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles,
                            bt_ptr + b * stride_btb, stride_btn, 0, seq_len, kvh, kvh * head_cols, page_rows,
                            head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES, True)
        i = gl.num_programs(0) + uniform(gl.atomic_add(counter_ptr, 1))
    hand_end(slots, k_ready, k_empty, it, STAGES)


@gluon.jit
def _consumer_partition(rows, slots, q_load, scales, WG: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SINKS: gl.constexpr,
                        SOFTCAP: gl.constexpr, Q_TMA: gl.constexpr, F8: gl.constexpr):
    """One warpgroup: rows ``WG * ROWS ..`` (``ROWS // GROUP`` tokens x ``GROUP`` heads) of each item the
    loader hands (``F8``: the converter, from an fp8 cache whose ``scales`` (k, v) fold into the scores' scale
    and the output); the next item's fields are read before this one's rows are stored."""
    (q_ptr, out_ptr, lse_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
     stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, sm_scale, cap, num_tokens) = rows
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if F8:
        qk_scale = qk_scale * gl.load(scales[0])
        v_scale = gl.load(scales[1])
    TOKS: gl.constexpr = ROWS // GROUP
    TOK: gl.constexpr = CONSUMERS * TOKS
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    _, _, q_ready, q_empty = q_load
    it = gl.to_tensor(0)
    n = gl.to_tensor(0)  # items so far (Q buffer n % 2)
    kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full = handed(slots, k_ready, it, STAGES)
    while n_tiles > 0:
        if Q_TMA:  # the loader's TMA: rows past the request hold its neighbours' (or zeros), never stored
            q_tile = q_smem.index((n % 2) * CONSUMERS + WG)
            mbarrier.wait(q_ready.index(n % 2), (n // 2) & 1)
        else:
            q_tile = q_smem.index(WG)
            r_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout()))
            tok_io = t0 + WG * TOKS + r_io // GROUP
            row_io = q_begin + tok_io
            ok_io = (tok_io < q_len) & (row_io >= 0) & (row_io < num_tokens)  # (bad metadata: no row out of bounds)
            load_rows(q_tile, q_ptr, row_io.to(gl.int64), kvh * GROUP + r_io % GROUP, ok_io, stride_qt, stride_qh,
                      D)
        if F8:
            q_tile = fp16_tile(q_tile)
        # key position of each row (padding rows act as the tile's last token: never without keys)
        r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        t_last = gl.minimum(t0 + TOK, q_len) - 1
        pos = off + gl.minimum(t0 + WG * TOKS + r_s // GROUP, t_last)
        acc, m_i, l_i = attend_tiles(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles, n_full,
                                     0, seq_len, pos, qk_scale, cap, D, BLOCK_N, STAGES, CAUSAL, True, SOFTCAP,
                                     True)
        it += n_tiles
        if Q_TMA:
            mbarrier.arrive(q_empty.index(n % 2), count=1)
            n += 1
        o, lse = finish_state(acc, m_i, l_i)
        if F8:
            o = o * v_scale
        nxt = handed(slots, k_ready, it, STAGES)
        _store_rows(rows, kvh, q_begin, q_len, t0, o, lse, WG, GROUP, D, BLOCK_N, SINKS)
        kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full = nxt


@gluon.jit
def _convert_partition(k_rings, v_rings, slots8, slots, STAGES: gl.constexpr):
    """Warps turning an fp8 cache's tiles into the consumers' fp16 tiles (:func:`ring_sm90.convert_range`),
    item by item; each item's fields go on to the consumers with its first K tile.
    ``k_rings`` / ``v_rings``: ((fp8 tiles, ready, empty), (16-bit tiles, ready, empty))."""
    it = gl.to_tensor(0)
    kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full = handed(slots8, k_rings[0][1], it, STAGES)
    while n_tiles > 0:
        hand(slots, k_rings[1][1], k_rings[1][2], it, (kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full),
             STAGES)
        it = convert_range(k_rings, v_rings, it, n_tiles)
        kvh, q_begin, q_len, t0, off, seq_len, n_tiles, n_full = handed(slots8, k_rings[0][1], it, STAGES)
    hand_end(slots, k_rings[1][1], k_rings[1][2], it, STAGES)


@gluon.jit
def _store_rows(rows, kvh, q_begin, q_len, t0, o, lse, WG: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr,
                BLOCK_N: gl.constexpr, SINKS: gl.constexpr):
    """A warpgroup's rows of an item: ``o [ROWS, D]`` (fp32) and ``lse [ROWS]`` into ``out`` / ``lse``
    (``SINKS``: each head's sink joins the state first)."""
    (_, out_ptr, lse_ptr, sinks_ptr, _, _, _, _, _, _, _, _, _, stride_ot, stride_oh, stride_lt, stride_lh, _, _,
     num_tokens) = rows
    TOKS: gl.constexpr = ROWS // GROUP
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    tok_l = t0 + WG * TOKS + r_s // GROUP
    qh_l = kvh * GROUP + r_s % GROUP
    row_l = q_begin + tok_l
    ok_l = (tok_l < q_len) & (row_l >= 0) & (row_l < num_tokens)
    if SINKS:  # a key of logit sinks[h] and value 0: only the denominator grows
        factor, lse = sink_scale(lse, gl.load(sinks_ptr + qh_l, mask=ok_l, other=0.0))
        o = o * gl.convert_layout(factor, gl.SliceLayout(1, o_layout))[:, None]
    gl.store(lse_ptr + row_l.to(gl.int64) * stride_lt + qh_l * stride_lh, lse, mask=ok_l)
    r_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout()))
    d_io = gl.arange(0, D, layout=gl.SliceLayout(0, io_layout()))
    tok_io = t0 + WG * TOKS + r_io // GROUP
    row_io = q_begin + tok_io
    ok_io = (tok_io < q_len) & (row_io >= 0) & (row_io < num_tokens)
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), io_layout())
    gl.store(out_ptr + row_io.to(gl.int64)[:, None] * stride_ot + (kvh * GROUP + r_io % GROUP)[:, None] * stride_oh
             + d_io[None, :], o, mask=ok_io[:, None])


@gluon.jit
def _prefill_sm90_kernel(
    q_ptr, q_desc, k_desc, v_desc, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr, sinks_ptr, counter_ptr,
    k_scale_ptr, v_scale_ptr, sm_scale, cap, num_tokens, batch, n_items, max_tokens, page_rows, head_rows, head_cols,
    oob_row,
    stride_qt, stride_qh, stride_btb, stride_btn, stride_sl, stride_qsl, stride_ot, stride_oh, stride_lt, stride_lh,
    GROUP: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_B: gl.constexpr, CAUSAL: gl.constexpr, SINKS: gl.constexpr, SOFTCAP: gl.constexpr,
    HKV: gl.constexpr, Q_TMA: gl.constexpr,
):
    """Persistent, one program an SM: its loader claims items (query tile x KV head) greedily (a causal
    request's heaviest first) and runs ahead into the next item's K/V tiles while the consumers finish one
    (they get each item's fields from the loader, so an item boundary costs them the Q load and the stores)."""
    TOK: gl.constexpr = CONSUMERS * ROWS // GROUP  # query tokens per item
    # Strides are >= 0 (torch's): their 64-bit products need no sign words, which the compiler would otherwise
    # compute before the partitions and carry into them (spilled: the loader has 48 registers).
    gl.assume(stride_qt >= 0)
    gl.assume(stride_qh >= 0)
    gl.assume(stride_ot >= 0)
    gl.assume(stride_oh >= 0)
    gl.assume(stride_lt >= 0)
    gl.assume(stride_lh >= 0)
    gl.assume(stride_btb >= 0)
    gl.assume(stride_sl >= 0)
    gl.assume(stride_qsl >= 0)
    meta = (qsl_ptr, seq_lens_ptr, stride_qsl, stride_sl, batch, max_tokens)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    F8: gl.constexpr = k_desc.dtype.is_fp8()
    q_bufs: gl.constexpr = 2 if Q_TMA else 1  # the loader fills the next item's Q while the consumers use one
    q_smem = gl.allocate_shared_memory(dtype, [q_bufs * CONSUMERS, ROWS, D],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype))
    # The consumers' ring: the cache's tiles, or over an fp8 cache the converter's 16-bit copies of those the
    # loader lands in a ring of its own
    if F8:  # fp16 operands, as the portable kernel's (attend.mma_operand): fp8 converts to fp16 in one instruction
        tile16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float16)
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_ring_of(gl.float16, tile16, BLOCK_N, D, STAGES,
                                                                           CONSUMERS)
        k8, v8, k8_ready, v8_ready, k8_empty, v8_empty = alloc_ring(k_desc, v_desc, BLOCK_N, STAGES, 1)
    else:
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_ring(k_desc, v_desc, BLOCK_N, STAGES, CONSUMERS)
    q_ready = gl.allocate_shared_memory(gl.int64, [q_bufs, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [q_bufs, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(q_bufs):
        mbarrier.init(q_ready.index(j), count=1)
        mbarrier.init(q_empty.index(j), count=CONSUMERS)
    q_load = (q_desc, q_smem, q_ready, q_empty)
    slots = gl.allocate_shared_memory(gl.int32, [STAGES, FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    rows = (q_ptr, out_ptr, lse_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, sm_scale, cap, num_tokens)
    scales = (k_scale_ptr, v_scale_ptr)
    if F8:  # the loader hands its items to the converter, which hands them on (warp_specialize's lists are inline)
        slots8 = gl.allocate_shared_memory(gl.int32, [STAGES, FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gl.warp_specialize([
            (_consumer_partition, (rows, slots, q_load, scales, 0, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS, SOFTCAP,
                                   Q_TMA, F8)),
            (_consumer_partition, (rows, slots, q_load, scales, 1, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS, SOFTCAP,
                                   Q_TMA, F8)),
            (_load_partition, (k_desc, v_desc, k8, v8, k8_ready, v8_ready, k8_empty, v8_empty, slots8, bt_ptr, meta,
                               counter_ptr, stride_btb, stride_btn, n_items, page_rows, head_rows, head_cols, oob_row,
                               q_load, TOK, BS, BLOCK_N, PAGE_BOX, STAGES, BLOCK_B, CAUSAL, HKV, Q_TMA)),
            (_convert_partition, (((k8, k8_ready, k8_empty), (k_smem, k_ready, k_empty)),
                                  ((v8, v8_ready, v8_empty), (v_smem, v_ready, v_empty)), slots8, slots, STAGES)),
        ], [4, 1, 2], CONVERT_REGS)
    else:
        gl.warp_specialize([
            (_consumer_partition, (rows, slots, q_load, scales, 0, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS, SOFTCAP,
                                   Q_TMA, F8)),
            (_consumer_partition, (rows, slots, q_load, scales, 1, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS, SOFTCAP,
                                   Q_TMA, F8)),
            (_load_partition, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, slots, bt_ptr,
                               meta, counter_ptr, stride_btb, stride_btn, n_items, page_rows, head_rows, head_cols,
                               oob_row, q_load, TOK, BS, BLOCK_N, PAGE_BOX, STAGES, BLOCK_B, CAUSAL, HKV, Q_TMA)),
        ], [4, 1], [232, 48])


def sm90_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap: float, window: int,
                scales) -> dict | None:
    """The Hopper kernel's settings for this call, or None when it does not cover it and the
    portable kernel runs (the caller checked the device: ``dispatch.use_sm90``). Covered: what
    :func:`ring_sm90.covered` covers (16-bit queries over a cache of their dtype or an fp8 one with its
    ``scales``), soft-capped or not, without a window.

    Tiles of 128 keys in two stages; over fp8, 64 keys in three: the fp8 ring and the 16-bit one the
    converter fills take 208 KB with the queries' (128-key tiles: 256 KB, over the 227 KB a program has)."""
    if window:
        return None
    view = covered(q, k_cache, v_cache, k_cache.element_size() == 1)
    if view is None:
        return None
    block_n, stages = (64, 3) if k_cache.element_size() == 1 else (128, 2)
    return dict(block_n=block_n, page_box=min(k_cache.shape[1], block_n), stages=stages, view=view, softcap=softcap,
                scales=scales)


def prefill_sm90(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale: float, causal: bool, out, lse,
                 cfg: dict, sinks=None):
    """The Hopper kernel over a call :func:`sm90_config` accepted (shapes as in ``prefill_triton``);
    ``block_table``, ``seq_lens`` and ``query_start_loc`` may be any strided views (read with their
    strides, no copies)."""
    t, hq, d = q.shape
    batch, (bs, hkv) = seq_lens.shape[0], k_cache.shape[1:3]
    group = hq // hkv
    view = cfg["view"]
    tok = CONSUMERS.value * ROWS.value // group
    block_b = min(1024, pow2(batch + 1))
    n_x = t // tok + batch  # query tiles (the requests' tiles laid end to end, one spare per request)
    grid = (min(n_x * hkv, num_sms(q.device)),)  # one program an SM (its shared memory)
    q_desc = q_descriptor(q, (ROWS.value // group, group, d))
    launch(
        _prefill_sm90_kernel, grid,
        q, q_desc, *descriptors(k_cache, v_cache, view, cfg["page_box"], cfg["block_n"]), block_table, seq_lens,
        query_start_loc, out, lse, lse if sinks is None else sinks, torch.zeros(1, dtype=torch.int32, device=q.device),
        *(lse if x is None else x for x in cfg["scales"]),  # (16-bit caches: not read)
        scale, cfg["softcap"] * LOG2E, t, batch, n_x * hkv, block_table.shape[1] * bs, *view[2:], view[0],
        q.stride(0), q.stride(1), *block_table.stride(), seq_lens.stride(0), query_start_loc.stride(0),
        out.stride(0), out.stride(1), *lse.stride(),
        GROUP=group, BS=bs, D=d, BLOCK_N=cfg["block_n"], PAGE_BOX=cfg["page_box"], STAGES=cfg["stages"],
        BLOCK_B=block_b, CAUSAL=bool(causal), SINKS=sinks is not None, SOFTCAP=cfg["softcap"] > 0, HKV=hkv,
        Q_TMA=q_desc is not None, num_warps=4,
    )
