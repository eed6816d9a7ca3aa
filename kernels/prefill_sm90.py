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

Pages are read as kernels/attend_sm90.py describes; boxes past the request's length load zeros,
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

from paged_backend.kernels.attend import LOG2E
from paged_backend.kernels.attend_sm90 import (CONSUMERS, ROWS, alloc_rings, attend_tiles, covered, descriptors,
                                               finish_state, io_layout, load_range, load_rows, mma_layout,
                                               sink_scale)
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
    return gl.sum(cnt, 0) - 1


@gluon.jit
def _load_partition(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, bt_row_ptr, stride_btn,
                    seq_len, n_tiles, kvh, page_rows, head_rows, head_cols, oob_row,
                    BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads of the request's K/V tiles ``0 .. n_tiles`` into their rings."""
    load_range(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, 0, n_tiles, bt_row_ptr, stride_btn,
               0, seq_len, kvh, kvh * head_cols, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)


@gluon.jit
def _consumer_partition(rows, WG: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, SINKS: gl.constexpr, SOFTCAP: gl.constexpr):
    """One warpgroup: rows ``WG * ROWS ..`` of the tile (``ROWS // GROUP`` tokens x ``GROUP`` heads)."""
    (q_ptr, out_ptr, lse_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
     stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, sm_scale, cap, q_begin, q_len, num_tokens,
     t0, off, seq_len, n_tiles, n_full, kvh) = rows
    TOKS: gl.constexpr = ROWS // GROUP
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)

    r_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout()))
    d_io = gl.arange(0, D, layout=gl.SliceLayout(0, io_layout()))
    tok_io = t0 + WG * TOKS + r_io // GROUP
    qh_io = kvh * GROUP + r_io % GROUP
    row_io = q_begin + tok_io
    ok_io = (tok_io < q_len) & (row_io >= 0) & (row_io < num_tokens)  # (bad metadata: no row out of bounds)
    row_io = row_io.to(gl.int64)
    q_tile = q_smem.index(WG)
    load_rows(q_tile, q_ptr, row_io, qh_io, ok_io, stride_qt, stride_qh, D)

    # key position of each row (padding rows act as the tile's last token: never without keys)
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    t_last = gl.minimum(t0 + CONSUMERS * TOKS, q_len) - 1
    pos = off + gl.minimum(t0 + WG * TOKS + r_s // GROUP, t_last)
    acc, m_i, l_i = attend_tiles(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, 0, n_tiles, n_full, 0,
                                 seq_len, pos, sm_scale * 1.4426950408889634, cap, D, BLOCK_N, STAGES, CAUSAL, True,
                                 SOFTCAP, True)
    o, lse = finish_state(acc, m_i, l_i)

    tok_l = t0 + WG * TOKS + r_s // GROUP
    qh_l = kvh * GROUP + r_s % GROUP
    row_l = q_begin + tok_l
    ok_l = (tok_l < q_len) & (row_l >= 0) & (row_l < num_tokens)
    if SINKS:  # a key of logit sinks[h] and value 0: only the denominator grows
        factor, lse = sink_scale(lse, gl.load(sinks_ptr + qh_l, mask=ok_l, other=0.0))
        o = o * gl.convert_layout(factor, gl.SliceLayout(1, o_layout))[:, None]
    gl.store(lse_ptr + row_l.to(gl.int64) * stride_lt + qh_l * stride_lh, lse, mask=ok_l)
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), io_layout())
    gl.store(out_ptr + row_io[:, None] * stride_ot + qh_io[:, None] * stride_oh + d_io[None, :], o,
             mask=ok_io[:, None])


@gluon.jit
def _prefill_sm90_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr, sinks_ptr,
    sm_scale, cap, num_tokens, batch, max_tokens, page_rows, head_rows, head_cols, oob_row,
    stride_qt, stride_qh, stride_btb, stride_btn, stride_sl, stride_qsl, stride_ot, stride_oh, stride_lt, stride_lh,
    GROUP: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr,
    STAGES: gl.constexpr, BLOCK_B: gl.constexpr, CAUSAL: gl.constexpr, SINKS: gl.constexpr, SOFTCAP: gl.constexpr,
):
    TOK: gl.constexpr = CONSUMERS * ROWS // GROUP  # query tokens per program
    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    b = _find_tile(qsl_ptr, stride_qsl, batch, pid, TOK, BLOCK_B, gl.num_warps())
    b64 = b.to(gl.int64)  # the metadata vectors are read with their strides (any views of wider buffers)
    q_begin = gl.load(qsl_ptr + b64 * stride_qsl)
    q_len = gl.load(qsl_ptr + (b64 + 1) * stride_qsl) - q_begin
    n_q = gl.cdiv(q_len, TOK)
    local = pid - (q_begin // TOK + b)
    if local < n_q:
        if CAUSAL:
            local = n_q - 1 - local  # heaviest tiles of a request first
        seq_len = gl.minimum(gl.load(seq_lens_ptr + b64 * stride_sl), max_tokens)
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
        bt_row_ptr = bt_ptr + b64 * stride_btb

        q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_rings(k_desc, v_desc, D, BLOCK_N, STAGES)

        rows = (q_ptr, out_ptr, lse_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, sm_scale, cap, q_begin, q_len,
                num_tokens, t0, off, seq_len, n_tiles, n_full, kvh)
        gl.warp_specialize([
            (_consumer_partition, (rows, 0, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS, SOFTCAP)),
            (_consumer_partition, (rows, 1, GROUP, D, BLOCK_N, STAGES, CAUSAL, SINKS, SOFTCAP)),
            (_load_partition, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, bt_row_ptr,
                               stride_btn, seq_len, n_tiles, kvh, page_rows, head_rows, head_cols, oob_row,
                               BS, BLOCK_N, PAGE_BOX, STAGES)),
        ], [4, 1], [240, 24])


def sm90_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap: float, window: int,
                scales) -> dict | None:
    """The Hopper kernel's settings for this call, or None when it does not cover it and the
    portable kernel runs (the caller checked the device: ``dispatch.use_sm90``). Covered: what
    :func:`attend_sm90.covered` covers, soft-capped or not, without window or fp8 scales."""
    if window or scales[0] is not None:
        return None
    view = covered(q, k_cache, v_cache)
    if view is None:
        return None
    block_n = 128
    return dict(block_n=block_n, page_box=min(k_cache.shape[1], block_n), stages=2, view=view, softcap=softcap)


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
    grid = (t // tok + batch, hkv)
    launch(
        _prefill_sm90_kernel, grid,
        q, *descriptors(k_cache, v_cache, view, cfg["page_box"], cfg["block_n"]), block_table, seq_lens,
        query_start_loc, out, lse, lse if sinks is None else sinks,
        scale, cfg["softcap"] * LOG2E, t, batch, block_table.shape[1] * bs, *view[2:], view[0],
        q.stride(0), q.stride(1), *block_table.stride(), seq_lens.stride(0), query_start_loc.stride(0),
        out.stride(0), out.stride(1), *lse.stride(),
        GROUP=group, BS=bs, D=d, BLOCK_N=cfg["block_n"], PAGE_BOX=cfg["page_box"], STAGES=cfg["stages"],
        BLOCK_B=block_b, CAUSAL=bool(causal), SINKS=sinks is not None, SOFTCAP=cfg["softcap"] > 0, num_warps=4,
    )
