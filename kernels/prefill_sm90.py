"""Paged prefill for Hopper (sm_90): TMA page loads, asynchronous wgmma, warp specialisation.

Same contract as :mod:`paged_backend.kernels.prefill` (rows, causal alignment, natural-log LSE,
the tile list without a host sync), written in Gluon so that the kernel controls what Triton's
compiler does not let a ``tl.dot`` kernel control (FlashAttention-3's structure):

- a **loader** warp streams the request's K/V pages with TMA into a ring of ``STAGES`` shared
  tiles (``BLOCK_N`` keys = ``BLOCK_N // PAGE_BOX`` page boxes each), signalling ``k_ready`` /
  ``v_ready`` mbarriers; it refills a K (V) stage once both consumers' GEMMs read it (``k_empty``,
  ``v_empty``);
- two **consumer** warpgroups own 64 query rows each (``TOK`` tokens x ``GROUP`` heads of one KV
  head) and run ``S = Q K^T`` and ``O += P V`` on the tensor cores (wgmma: Q and K, V from shared
  memory, P from registers). Within a warpgroup, tile ``j``'s ``Q K^T`` is issued before tile
  ``j-1``'s ``P V``, and tile ``j``'s softmax runs while that GEMM is in flight (FA-3's
  intra-warpgroup pipelining). The two warpgroups run unsynchronised: a ping-pong schedule making
  them take turns at the tensor cores measured no better (docs/prefill.md).

Pages: the caches are read through 2-D TMA descriptors over their storage, ``[rows, width]`` with
row stride ``stride_ks``; key ``n`` of KV head ``h`` of page ``p`` is row ``p * PAGE_ROWS + h *
HEAD_ROWS + n % BS``, column ``h * HEAD_COLS`` (NHD caches: ``HEAD_ROWS = 0``; HND caches:
``HEAD_COLS = 0``). Pages past the request's last are loaded from row ``rows`` (out of bounds: TMA
fills zeros), so no block-table entry past a request's length is ever used. Slots past the length
inside its last page may hold anything (NaN): scores there are masked, and the consumers zero those
rows of the V tile before ``P V`` (NaN x 0 is NaN).

Deterministic: every row's keys are folded in one fixed order. :func:`sm90_config` checks the subset
this kernel covers; everything else runs the portable kernel.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (wgmma's M per warpgroup)
CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program


@gluon.jit
def _find_tile(qsl_ptr, batch, pid, TOK: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr):
    """The program's request ``b``: the number of b in [0, B] with ``qsl[b] // TOK + b <= pid``,
    minus one (as in the portable kernel)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs_b = gl.arange(0, BLOCK_B, layout=layout)
    cnt = gl.zeros([BLOCK_B], gl.int32, layout=layout)
    for b0 in range(0, batch + 1, BLOCK_B):
        ib = b0 + offs_b
        start = gl.load(qsl_ptr + ib, mask=ib <= batch, other=0)
        cnt += ((start // TOK + ib <= pid) & (ib <= batch)).to(gl.int32)
    return gl.sum(cnt, 0) - 1


@gluon.jit
def _load_partition(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, bt_row_ptr, stride_btn, seq_len,
                    n_tiles, kvh, page_rows, head_rows, head_cols, oob_row,
                    BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads of the K/V tiles ``0 .. n_tiles`` into their rings. A K stage is
    refilled once both consumers' ``Q K^T`` read it, a V stage once both ``P V`` did."""
    col = kvh * head_cols
    for j in range(n_tiles):
        s = j % STAGES
        free = ((j // STAGES) & 1) ^ 1  # a fresh barrier passes phase 1
        _load_tile(k_desc, k_smem.index(s), k_ready.index(s), k_empty.index(s), free, bt_row_ptr, stride_btn,
                   j * BLOCK_N, seq_len, kvh, col, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX)
        _load_tile(v_desc, v_smem.index(s), v_ready.index(s), v_empty.index(s), free, bt_row_ptr, stride_btn,
                   j * BLOCK_N, seq_len, kvh, col, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX)


@gluon.jit
def _load_tile(desc, smem, ready, empty, free, bt_row_ptr, stride_btn, n0, seq_len, kvh, col, page_rows, head_rows,
               oob_row, BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` of one cache into ``smem`` once the stage is free: one TMA box per page."""
    mbarrier.wait(empty, free)
    mbarrier.expect(ready, BLOCK_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8)
    for i in gl.static_range(BLOCK_N // PAGE_BOX):
        row = _box_row(bt_row_ptr, stride_btn, n0 + i * PAGE_BOX, seq_len, kvh, page_rows, head_rows, oob_row, BS)
        tma.async_copy_global_to_shared(desc, [row, col], ready, smem.slice(i * PAGE_BOX, PAGE_BOX))


@gluon.jit
def _box_row(bt_row_ptr, stride_btn, n, seq_len, kvh, page_rows, head_rows, oob_row, BS: gl.constexpr):
    """TMA row of the page box starting at key ``n``. Boxes wholly past the length read out of
    bounds (zeros), so table entries past the request's last page are never used."""
    page = gl.load(bt_row_ptr + (n // BS) * stride_btn, mask=n < seq_len, other=0)
    return gl.where(n < seq_len, page * page_rows + kvh * head_rows + n % BS, oob_row)


@gluon.jit
def _softmax_tile(s_acc, m_i, l_i, qk_scale, keys, pos, seq_len, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """Online-softmax update of one tile of raw scores ``s_acc [ROWS, BLOCK_N]`` (exp2 domain)."""
    s = s_acc * qk_scale
    if MASKED:
        ok = keys[None, :] < seq_len
        if CAUSAL:
            ok = ok & (keys[None, :] <= pos[:, None])
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = m_new
    if MASKED:  # a row without keys yet (only with lengths the API rejects) exponentiates against 0
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_step(s_acc, m_i, l_i, qk_scale, keys, pos, seq_len, n_full, j, CAUSAL: gl.constexpr):
    """Tile ``j``: unmasked below ``n_full`` (every row sees all its keys), masked from there."""
    if j < n_full:
        p, alpha, m_i, l_i = _softmax_tile(s_acc, m_i, l_i, qk_scale, keys, pos, seq_len, False, CAUSAL)
    else:
        p, alpha, m_i, l_i = _softmax_tile(s_acc, m_i, l_i, qk_scale, keys, pos, seq_len, True, CAUSAL)
    return p, alpha, m_i, l_i


@gluon.jit
def _consumer_partition(rows, WG: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, SINKS: gl.constexpr):
    """One warpgroup: rows ``WG * ROWS ..`` of the tile (``ROWS // GROUP`` tokens x ``GROUP`` heads)."""
    (q_ptr, out_ptr, lse_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
     stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, sm_scale, q_begin, q_len, num_tokens,
     t0, off, seq_len, n_tiles, n_full, kvh) = rows
    TOKS: gl.constexpr = ROWS // GROUP
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte rows of [ROWS, D]
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # Q rows of this warpgroup -> shared memory (wgmma's A operand).
    r_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    d_io = gl.arange(0, D, layout=gl.SliceLayout(0, io_layout))
    tok_io = t0 + WG * TOKS + r_io // GROUP
    qh_io = kvh * GROUP + r_io % GROUP
    row_io = q_begin + tok_io
    ok_io = (tok_io < q_len) & (row_io < num_tokens)
    row_io = row_io.to(gl.int64)
    q = gl.load(q_ptr + row_io[:, None] * stride_qt + qh_io[:, None] * stride_qh + d_io[None, :],
                mask=ok_io[:, None], other=0.0)
    q_tile = q_smem.index(WG)
    q_tile.store(q)
    fence_async_shared()

    # key position of each row (padding rows act as the tile's last token: never without keys)
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    t_last = gl.minimum(t0 + CONSUMERS * TOKS, q_len) - 1
    pos = off + gl.minimum(t0 + WG * TOKS + r_s // GROUP, t_last)
    n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    # FA-3's intra-warpgroup pipeline: S_j = Q K_j^T is issued before P_{j-1} V_{j-1}, and the
    # softmax of S_j runs while that PV GEMM is in flight.
    mbarrier.wait(k_ready.index(0), 0)
    s_acc = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, n_s, pos, seq_len, n_full, 0, CAUSAL)
    for j in range(1, n_tiles):
        s = j % STAGES
        sp = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(sp), acc, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))  # wgmma groups complete in order
        mbarrier.arrive(k_empty.index(s), count=1)
        p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, n_s + j * BLOCK_N, pos, seq_len, n_full, j,
                                           CAUSAL)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(sp), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    last = n_tiles - 1
    s = last % STAGES
    mbarrier.wait(v_ready.index(s), (last // STAGES) & 1)
    v_tile = v_smem.index(s)
    if n_tiles * BLOCK_N > seq_len:
        # slots past the length hold anything (NaN x 0 is NaN): zero them; both warpgroups write
        # the same zeros, and only the last tile can reach past the length
        v = v_tile.load(io_layout)
        kv_io = last * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
        v_tile.store(gl.where(kv_io[:, None] < seq_len, v, gl.zeros_like(v)))
        fence_async_shared()
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_tile, acc)
    mbarrier.arrive(v_empty.index(s), count=1)

    # o = acc / l; lse = (m + log2 l) * ln 2 (natural log)
    empty = l_i == 0.0  # only for lengths the API rejects (seq_len 0 with q_len > 0)
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout))
    o = acc / l_o[:, None]
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    r_l = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    tok_l = t0 + WG * TOKS + r_l // GROUP
    qh_l = kvh * GROUP + r_l % GROUP
    row_l = q_begin + tok_l
    ok_l = (tok_l < q_len) & (row_l < num_tokens)
    if SINKS:  # a key of logit sinks[h] and value 0: only the denominator grows
        sink = gl.load(sinks_ptr + qh_l, mask=ok_l, other=0.0)
        new = gl.maximum(lse, sink) + gl.log(gl.exp(lse - gl.maximum(lse, sink)) + gl.exp(sink - gl.maximum(lse, sink)))
        o = o * gl.convert_layout(gl.exp(lse - new), gl.SliceLayout(1, o_layout))[:, None]
        lse = new
    gl.store(lse_ptr + row_l.to(gl.int64) * stride_lt + qh_l * stride_lh, lse, mask=ok_l)
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), io_layout)
    gl.store(out_ptr + row_io[:, None] * stride_ot + qh_io[:, None] * stride_oh + d_io[None, :], o,
             mask=ok_io[:, None])


@gluon.jit
def _prefill_sm90_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr, sinks_ptr,
    sm_scale, num_tokens, batch, max_tokens, page_rows, head_rows, head_cols, oob_row,
    stride_qt, stride_qh, stride_btb, stride_btn, stride_ot, stride_oh, stride_lt, stride_lh,
    GROUP: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_B: gl.constexpr, CAUSAL: gl.constexpr, SINKS: gl.constexpr,
):
    TOK: gl.constexpr = CONSUMERS * ROWS // GROUP  # query tokens per program
    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    b = _find_tile(qsl_ptr, batch, pid, TOK, BLOCK_B, gl.num_warps())
    q_begin = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_begin
    n_q = gl.cdiv(q_len, TOK)
    local = pid - (q_begin // TOK + b)
    if local < n_q:
        if CAUSAL:
            local = n_q - 1 - local  # heaviest tiles of a request first
        seq_len = gl.minimum(gl.load(seq_lens_ptr + b), max_tokens)
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
        bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_btb

        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, D], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=CONSUMERS)  # every consumer releases a stage
            mbarrier.init(v_empty.index(s), count=CONSUMERS)

        rows = (q_ptr, out_ptr, lse_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, sm_scale, q_begin, q_len, num_tokens,
                t0, off, seq_len, n_tiles, n_full, kvh)
        gl.warp_specialize([
            (_consumer_partition, (rows, 0, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS)),
            (_consumer_partition, (rows, 1, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS)),
            (_load_partition, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, bt_row_ptr,
                               stride_btn, seq_len, n_tiles, kvh, page_rows, head_rows, head_cols, oob_row,
                               BS, BLOCK_N, PAGE_BOX, STAGES)),
        ], [4, 1], [232, 40])


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


def sm90_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap: float, window: int,
                scales) -> dict | None:
    """The Hopper kernel's settings for this call, or None when it does not cover it and the
    portable kernel runs (the caller checked the device: ``dispatch.use_sm90``). Covered: fp16/bf16
    queries over a cache of the same dtype, head size 64 or 128, pages of 16+ tokens (a power of
    two), query heads per KV head a power of two up to 64, no soft-capping, window or fp8 scales,
    cache strides a TMA descriptor can take (:func:`page_view`)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return None
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if d not in (64, 128) or q.stride(2) != 1 or bs < 16 or bs & (bs - 1) or group > ROWS.value or group & (group - 1):
        return None
    if softcap or window or scales[0] is not None:
        return None
    kv = page_view(k_cache), page_view(v_cache)
    if None in kv or kv[0][2:] != kv[1][2:]:
        return None
    block_n = 128
    return dict(block_n=block_n, page_box=min(bs, block_n), stages=2, views=kv)


def prefill_sm90(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale: float, causal: bool, out, lse,
                 cfg: dict, sinks=None):
    """The Hopper kernel over a call :func:`sm90_config` accepted (shapes as in ``prefill_triton``)."""
    t, hq, d = q.shape
    batch, (bs, hkv) = seq_lens.shape[0], k_cache.shape[1:3]
    group = hq // hkv
    block_n, box = cfg["block_n"], cfg["page_box"]
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    descs = []
    for cache, (rows, width, *_) in zip((k_cache, v_cache), cfg["views"]):
        descs.append(TensorDescriptor(cache, [rows, width], [cache.stride(1), 1], [box, d], layout))
    _, _, page_rows, head_rows, head_cols = cfg["views"][0]
    tok = CONSUMERS.value * ROWS.value // group
    block_b = min(1024, triton.next_power_of_2(batch + 1))
    grid = (t // tok + batch, hkv)
    _prefill_sm90_kernel[grid](
        q, *descs, block_table, seq_lens, query_start_loc, out, lse, lse if sinks is None else sinks,
        scale, t, batch, block_table.shape[1] * bs, page_rows, head_rows, head_cols, cfg["views"][0][0],
        q.stride(0), q.stride(1), *block_table.stride(), out.stride(0), out.stride(1), *lse.stride(),
        GROUP=group, BS=bs, D=d, BLOCK_N=block_n, PAGE_BOX=box, STAGES=cfg["stages"], BLOCK_B=block_b,
        CAUSAL=bool(causal), SINKS=sinks is not None, num_warps=4,
    )
