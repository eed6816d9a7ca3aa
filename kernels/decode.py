"""Paged decode: one query token per request against its paged K/V.

The ``Hq / Hkv`` query heads that share a KV head are the rows of one tile (padded to >= 16 for
``tl.dot``), so each K/V tile is read once per group. Pages are looked up per token
(``block_table[b, n // BS]``, row ``n % BS``), so any power-of-two block size works and any cache
strides are accepted. Work comes from a :class:`paged_backend.decode_plan.DecodePlan`: each program runs
its pieces ``(request, kv_head, token range)`` in order (persistent stream-K, or one piece per
program for split-KV) and the pieces of a split segment are reduced in a fixed order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from paged_backend.decode_plan import PROGRAMS_PER_SM
from paged_backend.kernels.attend import LOG2E, add_sink, attend_paged_range, fast_tanh, fp8_mma_f16, mma_operand
from paged_backend.kernels.dispatch import num_sms, use_pdl, use_sm90
from paged_backend.kernels.launch import Relaunch, launch, pow2, replay_stream


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,  # a call's own tensors first (run_pieces)
    work_ptr, prog_ptr, po_ptr, plse_ptr, sinks_ptr, ks_ptr, vs_ptr,
    sm_scale, cap, max_tokens, window,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn, stride_sl,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    stride_pop, stride_poh, stride_pod,
    stride_plp, stride_plh,
    GROUP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr,
    WAIT_AT_END: tl.constexpr, WINDOW: tl.constexpr, SCALED: tl.constexpr, F16: tl.constexpr,
):
    if PDL:  # let the fold kernel launch now; it waits for this grid's writes (gdc_wait)
        gdc_launch_dependents()
    g = tl.program_id(0)
    p_lo = tl.load(prog_ptr + g)
    p_hi = tl.load(prog_ptr + g + 1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GROUP
    d_ok = offs_d < D
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    v_scale = 1.0
    if SCALED:  # an fp8 cache: k's scale folds into the scores' scale, v's into the output
        qk_scale = qk_scale * tl.load(ks_ptr)
        v_scale = tl.load(vs_ptr)
    for p in range(p_lo, p_hi):
        w = work_ptr + p * 5  # (request, kv_head, token_start, token_end, slot)
        b = tl.load(w).to(tl.int64)
        kvh = tl.load(w + 1).to(tl.int64)
        start = tl.load(w + 2)
        plan_end = tl.load(w + 3)
        if WINDOW:
            # A window plan partitions each request's last keys as [0, min(len, window)): shifted
            # here by the device length, so a plan from upper bounds still covers [len - window, len).
            seq_len = tl.load(seq_lens_ptr + b * stride_sl)
            lo = tl.maximum(seq_len - window, 0)
            start += lo
            plan_end += lo
        # The device lengths bound the range too: a plan made from upper bounds stays exact,
        # and nothing past the table's capacity is ever read. Page ids are read up to the plan's
        # bound, so the first of them does not wait for the length (one dependent load fewer).
        bt_end = tl.minimum(plan_end, max_tokens)
        if WINDOW:
            end = tl.minimum(bt_end, seq_len)
        else:
            end = tl.minimum(bt_end, tl.load(seq_lens_ptr + b * stride_sl))
        slot = tl.load(w + 4)
        qh = kvh * GROUP + offs_h  # query heads of this KV head  [BLOCK_H]
        q = mma_operand(tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                                mask=h_ok[:, None] & d_ok[None, :], other=0.0), F16)
        o, lse = attend_paged_range(q, k_ptr, v_ptr, bt_ptr + b * stride_btb, start, end, bt_end, start, kvh, offs_d,
                                    d_ok, qk_scale, cap, stride_kb, stride_ks, stride_kh, stride_kd,
                                    stride_vb, stride_vs, stride_vh, stride_vd, stride_btn,
                                    BS, BLOCK_H, BLOCK_N, BLOCK_D, IEEE, SOFTCAP, FAST_TANH, False)
        if SCALED:
            o = o * v_scale
        o_mask = h_ok[:, None] & d_ok[None, :]
        if slot < 0:  # the segment's only piece: write the output itself
            if SINKS:
                o, lse = add_sink(o, lse, tl.load(sinks_ptr + qh, mask=h_ok, other=0.0))
            tl.store(out_ptr + b * stride_ob + qh[:, None] * stride_oh + offs_d[None, :] * stride_od,
                     o.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.store(lse_ptr + b * stride_lb + qh * stride_lh, lse, mask=h_ok)
        else:
            slot64 = slot.to(tl.int64)
            tl.store(po_ptr + slot64 * stride_pop + offs_h[:, None] * stride_poh + offs_d[None, :] * stride_pod,
                     o, mask=o_mask)
            tl.store(plse_ptr + slot64 * stride_plp + offs_h * stride_plh, lse, mask=h_ok)
    if WAIT_AT_END:  # launched alongside a kernel it does not read: finish only after it, so the
        gdc_wait()   # next kernel's gdc_wait covers both


@triton.jit
def _fold_states_kernel(
    out_ptr, lse_ptr, list_ptr, slots_ptr, po_ptr, plse_ptr, sinks_ptr, HKV,
    stride_pop, stride_poh, stride_pod, stride_plp, stride_plh,
    stride_ob, stride_oh, stride_od, stride_lb, stride_lh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    INDIRECT: tl.constexpr, SKIP_SINGLE: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr,
):
    # Program (s = request * HKV + kv_head, query head h of the group, column block c): folds the
    # partial states of entries list[s]..list[s+1] in list order (deterministic) into out/lse, for
    # the BLOCK_D columns of block c (each block reads every lse; block 0 writes lse). An entry is a
    # partial slot itself, or with INDIRECT an index into slots. BLOCK_P states are loaded at once,
    # so a list of ~G/S pieces costs one or two dependent loads, not one per piece (a serial fold
    # cost ~10 us for B=1 on an H100). SKIP_SINGLE: a list of one entry was written out by its producer.
    s = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    lo = tl.load(list_ptr + s)  # plan data, written before the previous kernel started
    hi = tl.load(list_ptr + s + 1)
    offs_p = tl.arange(0, BLOCK_P)
    if INDIRECT:  # the first BLOCK_P entries' slots: plan data too, loaded before the wait
        first = tl.load(slots_ptr + lo + offs_p, mask=lo + offs_p < hi, other=0)
    # Launched early (programmatic dependent launch): wait until the states are written. Program
    # (0, 0) always waits, so this grid never completes before the one it follows.
    if PDL:
        if not SKIP_SINGLE or hi - lo > 1 or s + h == 0:
            gdc_wait()
    if not SKIP_SINGLE or hi - lo > 1:
        offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m = tl.full([1], float("-inf"), tl.float32)
        w_sum = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for p0 in range(lo, hi, BLOCK_P):
            p = p0 + offs_p
            p_ok = p < hi
            if INDIRECT:
                if p0 == lo:
                    p = first
                else:
                    p = tl.load(slots_ptr + p, mask=p_ok, other=0)
            p = p.to(tl.int64)
            lse = tl.load(plse_ptr + p * stride_plp + h * stride_plh, mask=p_ok, other=float("-inf"))  # [P]
            o = tl.load(po_ptr + p[:, None] * stride_pop + h * stride_poh + offs_d[None, :] * stride_pod,
                        mask=p_ok[:, None] & d_ok[None, :], other=0.0)  # [P, BLOCK_D]
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: no NaN
            alpha = tl.exp(m - m_safe)
            w = tl.exp(lse - m_safe)  # [P]
            w_sum = w_sum * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(o * w[:, None], 0)
            m = m_new
        empty = w_sum == 0.0  # an empty list or all states empty: o = 0, lse = -inf
        o = acc / tl.where(empty, 1.0, w_sum)
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, w_sum)))
        b = (s // HKV).to(tl.int64)
        qh = (s % HKV).to(tl.int64) * GROUP + h
        if SINKS:
            o2, lse = add_sink(o[None, :], lse, tl.load(sinks_ptr + qh + tl.arange(0, 1)))
            o = tl.reshape(o2, [BLOCK_D])
        tl.store(out_ptr + b * stride_ob + qh * stride_oh + offs_d * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=d_ok)
        if c == 0:
            tl.store(lse_ptr + b * stride_lb + qh * stride_lh + tl.arange(0, 1), lse)


def run_pieces(q, k_cache, v_cache, block_table, seq_lens, out, lse, partial_o, partial_lse, work, prog_ptr,
               num_programs: int, block_n: int, scale: float, pdl: bool, num_warps: int = 4, num_stages: int = 3,
               beside_prior: bool = False, softcap: float = 0.0, sinks=None, window: int = 0,
               scales=(None, None)) -> Relaunch | None:
    """Launches ``num_programs`` programs over decode pieces ``work [P, 5] int32`` (request, kv_head,
    token_start, token_end, slot). A piece with slot < 0 writes ``out``/``lse`` rows; one with a
    slot writes ``partial_o [P, group, D]``/``partial_lse [P, group]`` fp32. Tuned on an H200.
    ``pdl``: ``use_pdl(q.device)``. ``beside_prior`` (with PDL): the previous kernel on the stream
    neither feeds nor reads these pieces, so they start while it runs and the grid ends only after
    it. (Launching a decode early and waiting for the previous kernel before reading q was slower
    everywhere on an H100.) -> this launch again for new ``(q, k_cache, v_cache, block_table,
    seq_lens, out, lse)``, where it can go direct. ``softcap`` > 0 soft-caps the scores; ``sinks [Hq]``
    fp32 (or None) are added to the denominators of the states written to ``out``/``lse``.
    ``window`` > 0: the pieces' token ranges count from each request's ``max(0, len - window)``
    (a plan from ``plan_decode(window=...)``); 0: absolute token positions. ``scales``: an fp8
    cache's ``(k_scale, v_scale)`` ``[1]`` fp32 device tensors, or ``(None, None)``."""
    hq, d = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    beside_prior = beside_prior and pdl
    bound = launch(
        _decode_kernel, (num_programs,), q, k_cache, v_cache, block_table, seq_lens, out, lse,
        work, prog_ptr, partial_o, partial_lse, lse if sinks is None else sinks,
        *(lse if s is None else s for s in scales),
        scale, softcap * LOG2E, block_table.shape[1] * bs, window,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(), *seq_lens.stride(), *out.stride(),
        *lse.stride(), *partial_o.stride(), *partial_lse.stride(),
        GROUP=group, BS=bs, D=d, BLOCK_H=max(16, pow2(group)),  # tl.dot needs M >= 16
        BLOCK_N=block_n, BLOCK_D=pow2(d),
        IEEE=q.dtype == torch.float32, SOFTCAP=softcap > 0, FAST_TANH=fast_tanh(q), SINKS=sinks is not None,
        PDL=pdl, WAIT_AT_END=beside_prior, WINDOW=window > 0, SCALED=scales[0] is not None,
        F16=fp8_mma_f16(q, k_cache), num_warps=num_warps,
        num_stages=num_stages, **({"launch_pdl": True} if beside_prior else {}),
    )
    return bound and bound.lead(7)


def fold_states(lists, partial_o, partial_lse, out, lse, num_kv_heads: int, pdl: bool, slots=None,
                skip_single: bool = False, max_len: int = 64, sinks=None) -> Relaunch | None:
    """Merges, per (request, kv_head) ``s``, the partial states ``lists[s]..lists[s+1]``
    (``lists [B * Hkv + 1]`` int32; entries are slots of ``partial_o [P, group, D]`` /
    ``partial_lse [P, group]``, or indices into ``slots`` when given) in order into
    ``out [B, Hq, D]`` and ``lse [B, Hq]``. ``max_len``: the usual longest list, loaded in one go
    (longer lists take more rounds). ``pdl`` (``use_pdl(out.device)``, Hopper and later): launched
    with programmatic dependent launch, it starts during the previous kernel and waits for its
    writes. -> this launch again for new ``(out, lse)``, where it can go direct.

    With fewer (request, query head) rows than the device has SMs, each row's columns are split over
    up to 4 programs of >= 32 columns: one program reads a whole list alone, so a long list over
    few SMs is bound by one SM's bandwidth (MQA B=1 x 128K on an H100: 264 states a list over 32
    SMs, 46.5 us end to end). The split is a function of the shapes only: same inputs, same bits."""
    b, hq, d = out.shape
    block_p = fold_block_p(max_len)
    rows = b * hq
    split = 1
    sms = num_sms(out.device)
    while split < 4 and rows * split < sms and pow2(d) // (2 * split) >= 32:
        split *= 2
    bound = launch(
        _fold_states_kernel, (b * num_kv_heads, hq // num_kv_heads, split),
        out, lse, lists, lists if slots is None else slots, partial_o, partial_lse,
        lse if sinks is None else sinks, num_kv_heads,
        *partial_o.stride(), *partial_lse.stride(), *out.stride(), *lse.stride(),
        GROUP=hq // num_kv_heads, D=d, BLOCK_P=block_p, BLOCK_D=pow2(d) // split,
        INDIRECT=slots is not None, SKIP_SINGLE=skip_single, SINKS=sinks is not None, PDL=pdl,
        num_warps=_fold_warps(block_p), num_stages=1, **({"launch_pdl": True} if pdl else {}),
    )
    return bound and bound.lead(2)


def fold_block_p(max_len: int) -> int:
    """States a fold program loads at once for lists of usually ``max_len`` slots."""
    return min(64, pow2(max(2, max_len)))


def _fold_warps(block_p: int) -> int:
    """Warps of a fold program loading ``block_p`` states of ``BLOCK_D`` columns at once: few, since the
    sum over states crosses warps through shared memory (H100, 2026-11-26: one warp for <= 8 states folds
    the cascade's lists 31-35% faster than two, and four take 2.5x as long; two and one even at 16;
    ``results/sweeps/fold_warps_h100.log``)."""
    return 1 if block_p <= 8 else 4 if block_p >= 32 else 2


def call_key(tensors: tuple, *values) -> tuple:
    """A plan's key for a call's launches (its own buffers are fixed): the dtypes of the first two
    (q and the cache, which may be fp8 of either format: the others' are checked against them),
    strides and 16-byte alignment of the call's ``tensors`` and ``values`` (the scale, PDL, ...).
    -> (key, the tensors' data pointers: what relaunches take)."""
    ptrs = [*map(torch.Tensor.data_ptr, tensors)]
    return (tensors[0].dtype, tensors[1].dtype, *map(torch.Tensor.stride, tensors), *values,
            *map((15).__and__, ptrs)), ptrs


def remember(launches: dict, key: tuple, relaunches: tuple) -> None:
    """Keeps a call's relaunches in its plan's ``launches`` (a plan sees a few call signatures;
    the bound keeps a caller varying its strides from growing it without end)."""
    if all(relaunches):
        if len(launches) >= 64:
            launches.clear()
        launches[key] = relaunches


def decode_triton(q, k_cache, v_cache, block_table, seq_lens, plan, scale: float, out, lse, softcap: float = 0.0,
                  sinks=None, scales=(None, None)):
    """q [B, Hq, D]; caches [NB, BS, Hkv, D]; writes out [B, Hq, D] and lse [B, Hq] (fp32, ln).
    ``softcap`` > 0: scores soft-capped (0: none); ``sinks [Hq]`` fp32 or None. The sliding window
    is the plan's (``plan.window``). ``scales``: an fp8 cache's ``(k_scale, v_scale)`` ``[1]`` fp32
    tensors, or ``(None, None)``."""
    if q.shape[0] == 0:
        return
    pdl = use_pdl(q.device)
    # The plan's launches for this call signature: after the first call, each layer and step
    # calls the two launchers directly (an eager call is host-bound for small batches).
    # (the cache's blocks: the Hopper kernel's TMA descriptors bound them)
    key, ptrs = call_key((q, k_cache, v_cache, block_table, seq_lens, out, lse), scale, softcap, pdl,
                         block_table.shape[1], k_cache.shape[0], plan.whole, sinks is not None and sinks.data_ptr(),
                         *(s is not None and s.data_ptr() for s in scales))
    relaunches = plan.launches.get(key)
    if relaunches is not None:
        stream = replay_stream(relaunches)
        if stream is not None:
            decode, fold = relaunches
            decode(stream, *ptrs)
            fold(stream, *ptrs[5:])
            return
    view = _sm90_view(q, k_cache, v_cache, plan)
    if view is not None:
        from paged_backend.kernels.decode_sm90 import decode_sm90
        decode = decode_sm90(q, k_cache, v_cache, block_table, seq_lens, out, lse, plan, scale, scales, view, pdl,
                             softcap, sinks)
    else:
        tile_n, stages = plan.kernel_tile
        if k_cache.element_size() == 1:  # fp8: twice the tokens a tile (the same bytes), 3 stages (H100 sweep),
            # but the plan's own tiles where it has 3+ programs an SM (fp8 plans on Hopper, for calls the Hopper
            # kernel does not take), so that they fit at once (H200, B8x32K: 215.2 us at 2 an SM, 277.6 at 3
            # with 128 tokens a tile, 222.0 with 64; B4x2K 18.2 / 25.6 / 16.1; sweeps/decode_fp8_programs_h200.log)
            tile_n, stages = (plan.block_n if plan.programs_an_sm > PROGRAMS_PER_SM else 2 * plan.block_n), 3
        decode = run_pieces(q, k_cache, v_cache, block_table, seq_lens, out, lse, plan.partial_o, plan.partial_lse,
                            plan.work, plan.prog_ptr, plan.num_programs, tile_n, scale, pdl, num_stages=stages,
                            softcap=softcap, sinks=sinks, window=plan.window or 0, scales=scales)
    # A segment of one piece wrote out/lse itself; split segments are folded in piece order. A
    # stream-K run of G programs over S segments gives each at most ~G/S + 2 pieces.
    segments = q.shape[0] * k_cache.shape[2]
    fold = fold_states(plan.seg_ptr, plan.partial_o, plan.partial_lse, out, lse, k_cache.shape[2], pdl,
                       skip_single=True, max_len=-(-plan.num_programs // segments) + 2, sinks=sinks)
    remember(plan.launches, key, (decode, fold))


def _sm90_view(q, k_cache, v_cache, plan):
    """The caches' TMA view where the Hopper decode kernel (kernels/decode_sm90.py) runs the call, else None."""
    if not use_sm90(q.device):
        return None
    from paged_backend.kernels.decode_sm90 import covered
    return covered(q, k_cache, v_cache, plan)
