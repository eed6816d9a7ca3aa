"""Paged prefill: varlen causal attention of new query tokens over their request's paged K/V.

Request ``b`` owns query rows ``query_start_loc[b] : query_start_loc[b+1]`` of ``q [T, Hq, D]``;
they are its *last* ``q_len_b`` tokens, at key positions ``seq_len_b - q_len_b + i`` (the K/V of
those tokens are already in the cache). Causal: query ``i`` sees keys ``0 .. seq_len_b - q_len_b
+ i`` (bottom-right aligned); non-causal: all ``seq_len_b`` keys.

Kernel (FlashAttention-2 over the paged cache): one program = one query tile of one request and
one KV head. The rows of a tile are ``(query token, head in group)`` pairs, ``TOK = BLOCK_M //
GROUP`` tokens x ``GROUP`` heads, so each K/V tile is read once per GQA group and feeds a
``BLOCK_M x BLOCK_N`` tensor-core GEMM. Keys are walked in ``BLOCK_N`` tiles with the page looked
up per token (``block_table[b, n // BS]``, row ``n % BS``): any block size, any cache strides,
chunk starts not aligned to pages. KV tiles wholly below the diagonal run without masks; the one
or two tiles on the diagonal (or the ragged tail) run masked; tiles above it are never visited.

Tile list without a host sync: request ``b``'s tiles are numbered from ``base_b =
query_start_loc[b] // TOK + b``. Since ``base_{b+1} - base_b >= ceil(q_len_b / TOK)``, the
ranges never overlap, and ``T // TOK + B`` programs per KV head cover every tile of any batch with
``T`` tokens and ``B`` requests (at most ``B`` of them find no tile and exit at once). Each program
finds its request by counting ``base_b <= pid`` over ``query_start_loc`` (one vector load, it
sits in L2). The grid therefore depends only on shapes: no device-to-host copy, no extra launch,
CUDA-graph capturable. Within a request, causal tiles run last-first (the longest first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_backend.kernels.attend import LOG2E, add_sink, fast_tanh, scale_scores


@triton.jit
def _prefill_kv_tile(
    acc, l_i, m_i, q, k_ptr, v_ptr, bt_row_ptr, n0, hi, pos, window, qk_scale, cap,
    kvh, stride_btn, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    offs_n, offs_d, d_ok,
    BS: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, WINDOW: tl.constexpr,
):
    """One BLOCK_N tile of keys ``n0 ..`` folded into the running state (exp2 domain). ``WINDOW``
    (masked tiles): keys at or below ``pos - window`` are masked too."""
    tok = n0 + offs_n
    row = (tok % BS).to(tl.int64)
    if MASKED:
        t_ok = tok < hi
        page = tl.load(bt_row_ptr + (tok // BS) * stride_btn, mask=t_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + (tok // BS) * stride_btn).to(tl.int64)
    k_ptrs = k_ptr + (page * stride_kb + row * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + (page * stride_vb + row * stride_vs + kvh * stride_vh)[:, None] + offs_d[None, :] * stride_vd
    if MASKED:
        k = tl.load(k_ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
    k = k.to(q.dtype)  # (an fp8 cache's values; its scales are applied by the caller)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = scale_scores(s, qk_scale, cap, SOFTCAP, FAST_TANH)  # [BLOCK_M, BLOCK_N]
    if MASKED:
        if CAUSAL:
            ok = (tok[None, :] <= pos[:, None]) & t_ok[None, :]
        else:
            ok = t_ok[None, :]
        if WINDOW:
            ok = ok & (tok[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
    # Without a window every row sees key 0 in its first tile, so m_new is finite from the first
    # tile on; with one, a row may see no key in its first tiles: exponentiate against 0 then.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if WINDOW:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    v = v.to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, lse_ptr, sinks_ptr, ks_ptr, vs_ptr,
    sm_scale, cap, num_tokens, batch, max_tokens, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn, stride_sl, stride_qsl,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, SINKS: tl.constexpr,
    WINDOW: tl.constexpr, SCALED: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    # Request of this program: the number of b in [0, B] with base_b = qsl[b] // TOK + b <= pid,
    # minus one (base_0 = 0 <= pid, and base_B > pid for every pid of the grid).
    offs_b = tl.arange(0, BLOCK_B)
    cnt = tl.zeros([BLOCK_B], tl.int32)
    for b0 in range(0, batch + 1, BLOCK_B):
        ib = b0 + offs_b
        start = tl.load(qsl_ptr + ib * stride_qsl, mask=ib <= batch, other=0)
        cnt += ((start // TOK + ib <= pid) & (ib <= batch)).to(tl.int32)
    b = tl.sum(cnt, 0) - 1
    q_begin = tl.load(qsl_ptr + b * stride_qsl)
    q_len = tl.load(qsl_ptr + (b + 1) * stride_qsl) - q_begin
    n_tiles = tl.cdiv(q_len, TOK)
    local = pid - (q_begin // TOK + b)
    if local >= n_tiles:
        return
    if CAUSAL:
        local = n_tiles - 1 - local  # heaviest tiles of a request first
    b64 = b.to(tl.int64)
    # The table's capacity bounds every read; a q_len above seq_len (rejected by the API when it
    # can see the lengths) is clamped rather than read out of bounds.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b64 * stride_sl), max_tokens)
    off = tl.maximum(seq_len - q_len, 0)  # key position of the request's first query token
    t0 = local * TOK
    t_last = tl.minimum(t0 + TOK, q_len) - 1

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    tok = t0 + offs_m // GROUP  # query token (within the request) of each row
    qh = kvh * GROUP + offs_m % GROUP  # query head of each row
    q_row = q_begin + tok
    row_ok = (offs_m < TOK * GROUP) & (tok < q_len) & (q_row >= 0) & (q_row < num_tokens)
    q_row = q_row.to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + qh[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    # Padding rows act as the tile's last token: no row is ever without keys, so no NaN.
    pos = off + tl.minimum(tok, t_last)
    if CAUSAL:
        hi = tl.minimum(off + t_last + 1, seq_len)
        full = tl.minimum((off + t0 + 1) // BLOCK_N * BLOCK_N, hi)  # every row sees keys < off + t0 + 1
    else:
        hi = seq_len
        full = seq_len // BLOCK_N * BLOCK_N

    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if SCALED:  # an fp8 cache: k's scale folds into the scores' scale (v's is applied at the end)
        qk_scale = qk_scale * tl.load(ks_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + b64 * stride_btb
    first = 0  # the first key tile; [first, lo_full) runs masked (some rows' windows start there)
    lo_full = 0
    if WINDOW:  # (causal) row of position p sees keys > p - window: skip tiles below every row's
        first = tl.maximum(off + t0 - window + 1, 0) // BLOCK_N * BLOCK_N
        lo_full = tl.minimum(tl.cdiv(tl.maximum(off + t_last - window + 1, 0), BLOCK_N) * BLOCK_N, full)
        for n0 in range(first, lo_full, BLOCK_N):
            acc, l_i, m_i = _prefill_kv_tile(
                acc, l_i, m_i, q, k_ptr, v_ptr, bt_row_ptr, n0, hi, pos, window, qk_scale, cap,
                kvh, stride_btn, stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_ok,
                BS=BS, MASKED=True, CAUSAL=CAUSAL, EVEN_D=D == BLOCK_D, IEEE=IEEE, SOFTCAP=SOFTCAP,
                FAST_TANH=FAST_TANH, WINDOW=True)
        lo_full = tl.maximum(lo_full, first)
    for n0 in range(lo_full, full, BLOCK_N):
        acc, l_i, m_i = _prefill_kv_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, bt_row_ptr, n0, hi, pos, window, qk_scale, cap,
            kvh, stride_btn, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_ok,
            BS=BS, MASKED=False, CAUSAL=CAUSAL, EVEN_D=D == BLOCK_D, IEEE=IEEE, SOFTCAP=SOFTCAP, FAST_TANH=FAST_TANH,
            WINDOW=False)
    for n0 in range(tl.maximum(full, lo_full), hi, BLOCK_N):
        acc, l_i, m_i = _prefill_kv_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, bt_row_ptr, n0, hi, pos, window, qk_scale, cap,
            kvh, stride_btn, stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d, d_ok,
            BS=BS, MASKED=True, CAUSAL=CAUSAL, EVEN_D=D == BLOCK_D, IEEE=IEEE, SOFTCAP=SOFTCAP, FAST_TANH=FAST_TANH,
            WINDOW=WINDOW)

    empty = l_i == 0.0  # only for lengths the API rejects (seq_len 0 with q_len > 0)
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SCALED:
        o = o * tl.load(vs_ptr)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if SINKS:
        o, lse = add_sink(o, lse, tl.load(sinks_ptr + qh, mask=row_ok, other=0.0))
    tl.store(out_ptr + q_row[:, None] * stride_ot + qh[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + q_row * stride_lt + qh * stride_lh, lse, mask=row_ok)


def prefill_config(dtype: torch.dtype, head_dim: int, group: int, device: torch.device) -> dict:
    """Tile sizes and launch settings: Hopper-sized tiles on CUDA, small ones for the interpreter."""
    block_d = triton.next_power_of_2(head_dim)
    if device.type != "cuda":  # interpreter: few, small programs
        cfg = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)
    elif dtype == torch.float32:
        cfg = dict(block_m=64, block_n=32 if block_d <= 128 else 16, num_warps=4, num_stages=2)
    elif block_d <= 128:
        # 256 rows on 16 warps: four warpgroups in flight overlap one's softmax with another's
        # wgmma (H100, 2026-11-21: 1x8K 329 -> 382 TFLOP/s, 2K over 30K 318 -> 388, vs 128 x 64 on 8)
        cfg = dict(block_m=256, block_n=64, num_warps=16, num_stages=3)
    else:
        cfg = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
    cfg["block_m"] = max(cfg["block_m"], triton.next_power_of_2(group))
    return cfg


def prefill_triton(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale: float, causal: bool,
                   out, lse, block_m: int | None = None, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, softcap: float = 0.0, sinks=None,
                   window: int = 0, scales=(None, None)):
    """q [T, Hq, D]; caches [NB, BS, Hkv, D]; query_start_loc [B+1] int32 (device); writes
    out [T, Hq, D] and lse [T, Hq] (fp32, ln). Tile settings default to :func:`prefill_config`.
    ``softcap`` > 0: scores soft-capped (0: none); ``sinks [Hq]`` fp32 or None; ``window`` > 0
    (causal only): a query at position p sees keys > p - window, and key tiles below every row's
    window are not visited. ``scales``: an fp8 cache's ``(k_scale, v_scale)`` ``[1]`` fp32 tensors."""
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    batch = seq_lens.shape[0]
    group = hq // hkv
    if t == 0 or batch == 0:
        return
    cfg = prefill_config(q.dtype, d, group, q.device)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    if block_m < group or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= max(16, group {group}), got {block_m}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    tok = block_m // group
    block_b = min(1024, triton.next_power_of_2(batch + 1))
    grid = (t // tok + batch, hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, lse, lse if sinks is None else sinks,
        *(lse if s is None else s for s in scales),
        scale, softcap * LOG2E, t, batch, block_table.shape[1] * bs, window,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        *seq_lens.stride(), *query_start_loc.stride(), *out.stride(), *lse.stride(),
        GROUP=group, BS=bs, D=d, TOK=tok, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_B=block_b,
        CAUSAL=bool(causal), IEEE=q.dtype == torch.float32, SOFTCAP=softcap > 0, FAST_TANH=fast_tanh(q),
        SINKS=sinks is not None, WINDOW=window > 0, SCALED=scales[0] is not None,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
