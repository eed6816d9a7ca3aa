"""Cascade (shared-prefix) decode kernels.

Three launches, all with grids fixed by the plan:

1. ``_cascade_node_kernel``: a piece = (node, kv_head, row block, token range). Rows are
   (request in node, query head of the KV group) pairs - ``MPB`` requests x ``GP`` (group padded to a
   power of two) = ``BLOCK_M`` rows - so the node's K/V tiles are read once for all its requests and
   attended with tensor-core ``tl.dot`` (a real GEMM). Pages come from the block-table row of one
   member (the ids are identical by construction). Node token ranges are laid end to end and cut
   stream-K over persistent programs; every piece writes one fp32 partial state per request.
2. ``_decode_kernel`` (kernels/decode.py) runs the private tails as decode pieces, stream-K, each
   writing a partial slot.
3. ``_fold_states_kernel`` (kernels/decode.py): per (request, query head), folds its partial
   slots in the plan's fixed order (parents first, tail last) into ``out``/``lse``. Deterministic;
   an empty list gives o = 0, lse = -inf.

On Hopper and later the three run on one stream chained by programmatic dependent launch: the
tails start while the node kernel runs (they write other slots) and finish after it; the merge
starts during the tails and waits for their writes. Elsewhere nodes and tails run on two streams.
On sm_90, plans with fused lists (paged_backend/cascade/fused.py, ``fused_prog_ptr``) run the node
and tail pieces in one launch of the Hopper kernel (kernels/cascade_sm90.py: side by side on each SM),
then the merge (over fp8 caches only plans with short node GEMMs have such lists: ``CascadeCost.fp8_fused_flops``);
other fp8 plans' tails run on the Hopper decode kernel (kernels/decode_sm90.py ``pieces_sm90``, three programs an
SM: ``cascade.fused.hopper_tails``), launched beside the node kernel - whose programs leave no room for them until
it ends (results/sweeps/cascade_fp8_sm90_h200.log section 4).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from paged_backend.kernels.attend import (LOG2E, attend_paged_range, dequantized, fast_tanh, fp8_mma_f16, mma_operand,
                                          sink_states, soft_cap)
from paged_backend.cascade.fused import hopper_tails
from paged_backend.kernels.decode import call_key, fold_states, remember, run_pieces
from paged_backend.kernels.dispatch import num_sms, q_tma, use_pdl, use_sm90
from paged_backend.kernels.launch import launch, pow2, replay_stream

# The largest group whose tails the Hopper node kernel runs beside its node pieces (kernels/cascade_sm90.py):
# at 16 its tails' consumer spills in the registers it has there.
SM90_TAIL_GROUP = 8

# Warps per node tile of BLOCK_M rows (H100 sweeps, 2026-11-21): a 256-row tile on 16 warps keeps
# four warpgroups in flight, so one's softmax overlaps another's wgmma; at 128 registers a thread
# it spills a little and is still faster than two 128-row tiles on 8 warps (32768/256/256: node
# 436 -> 344 us, 315 -> 400 TFLOP/s; 4096/256/128: 62.7 -> 55.6 us).
_NODE_WARPS = {16: 4, 32: 4, 64: 4, 128: 8, 256: 16}


@triton.jit
def _cascade_node_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, members_ptr, work_ptr, prog_ptr, po_ptr, plse_ptr, seq_lens_ptr, ks_ptr, vs_ptr,
    sm_scale, cap, window,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_pop, stride_poh, stride_pod,
    stride_plp, stride_plh,
    GROUP: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr, SCALED: tl.constexpr,
    F16: tl.constexpr,
):
    if PDL:  # the tails (and the merge) may launch now: they wait for this grid where they must
        gdc_launch_dependents()
    g = tl.program_id(0)
    p_lo = tl.load(prog_ptr + g)
    p_hi = tl.load(prog_ptr + g + 1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mem = offs_m // GP  # request of the row within the row block
    hh = offs_m % GP    # query head within the KV group
    d_ok = offs_d < D
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    v_scale = 1.0
    if SCALED:  # an fp8 cache (as in the decode kernel)
        qk_scale = qk_scale * tl.load(ks_ptr)
        v_scale = tl.load(vs_ptr)
    for p in range(p_lo, p_hi):
        w = work_ptr + p * 7  # (rep request, kv_head, member base, members, token_start, token_end, slot base)
        rep = tl.load(w).to(tl.int64)
        kvh = tl.load(w + 1).to(tl.int64)
        mbase = tl.load(w + 2)
        n_in = tl.load(w + 3)
        start = tl.load(w + 4)
        end = tl.load(w + 5)
        slot_base = tl.load(w + 6)
        m_ok = mem < n_in
        row_ok = m_ok & (hh < GROUP)
        req = tl.load(members_ptr + mbase + mem, mask=m_ok, other=0).to(tl.int64)
        qh = kvh * GROUP + hh
        q = mma_operand(tl.load(q_ptr + req[:, None] * stride_qb + qh[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                                mask=row_ok[:, None] & d_ok[None, :], other=0.0), F16)
        row_lo = start
        if WINDOW:  # each member attends only its last `window` keys: a row's own lower bound
            row_lo = tl.maximum(tl.load(seq_lens_ptr + req, mask=m_ok, other=0) - window, 0)
        o, lse = attend_paged_range(q, k_ptr, v_ptr, bt_ptr + rep * stride_btb, start, end, end, row_lo, kvh, offs_d,
                                    d_ok, qk_scale, cap, stride_kb, stride_ks, stride_kh, stride_kd,
                                    stride_vb, stride_vs, stride_vh, stride_vd, stride_btn,
                                    BS, BLOCK_M, BLOCK_N, BLOCK_D, IEEE, SOFTCAP, FAST_TANH, WINDOW)
        if SCALED:
            o = o * v_scale
        slot = (slot_base + mem).to(tl.int64)
        tl.store(po_ptr + slot[:, None] * stride_pop + hh[:, None] * stride_poh + offs_d[None, :] * stride_pod,
                 o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(plse_ptr + slot * stride_plp + hh * stride_plh, lse, mask=row_ok)


def cascade_triton(q, k_cache, v_cache, plan, scale: float, out, lse, softcap: float = 0.0, sinks=None,
                   scales=(None, None)):
    """q [B, Hq, D]; caches [NB, BS, Hkv, D]; a non-flat CascadePlan; writes out [B, Hq, D], lse [B, Hq].
    ``softcap`` > 0: scores soft-capped (0: none); ``sinks [Hq]`` fp32 or None. With the plan's
    sliding window, node rows mask the keys before their member's window (the plan trimmed each
    node to its members' windows and dropped nodes no window reaches) and the tails' ranges
    start at the window. ``scales``: an fp8 cache's ``(k_scale, v_scale)`` ``[1]`` fp32 tensors, or
    ``(None, None)``."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if b == 0:
        return
    gp = pow2(group)
    block_d = pow2(d)
    ieee = q.dtype == torch.float32
    v = plan.views
    bt = v["block_table"]
    sl = v["seq_lens"]
    po, plse = plan.partial_o, plan.partial_lse
    pdl = use_pdl(q.device)
    # which launches run: those with pieces, or all of them (a fixed arena's plans launch alike)
    run_nodes, run_tails = plan.launch_all or plan.num_node_pieces > 0, plan.launch_all or plan.num_leaf_pieces > 0
    both = run_nodes and run_tails
    # (a plan with "fused_prog_ptr" is for Hopper, where the node kernel may run the tails as well)
    one_stream = pdl or not (q.is_cuda and both) or "fused_prog_ptr" in v
    # As in decode_triton: after the first call with this signature (the first layer of a step),
    # the plan's launchers are called directly. Only the one-stream order is kept.
    relaunches = None
    if one_stream:
        # (bt, sl: the plan's; the cache's shape: the Hopper node kernel's TMA descriptors span it)
        key, ptrs = call_key((q, k_cache, v_cache, bt, sl, out, lse), k_cache.shape[0], scale, softcap, pdl,
                             sinks is not None and sinks.data_ptr(), *(s is not None and s.data_ptr() for s in scales))
        relaunches = plan.launches.get(key)
    if relaunches is not None:
        stream = replay_stream(relaunches)
        if stream is not None:
            # the plan's launches in order, each with the call's leading arguments (no tails
            # launch where the Hopper node kernel ran them)
            leads = [ptrs[:3]] if run_nodes else []
            if len(relaunches) - len(leads) == 2:
                leads.append(ptrs)
            for relaunch, lead in zip(relaunches, leads + [ptrs[5:]]):
                relaunch(stream, *lead)
            return

    sm90 = node_sm90_config(q, k_cache, v_cache, plan, softcap, scales) if run_nodes else None
    fused = sm90 is not None and runs_tails(plan, q)  # the Hopper node kernel runs the tails too

    def nodes():
        if sm90 is not None:  # Hopper: kernels/cascade_sm90.py
            from paged_backend.kernels.cascade_sm90 import cascade_nodes_sm90
            return cascade_nodes_sm90(q, k_cache, v_cache, plan, scale, sm90, pdl, fused)
        bm = plan.block_m
        bound = launch(
            _cascade_node_kernel, (plan.node_programs,),
            q, k_cache, v_cache, bt, v["members"], v["node_work"], v["node_prog_ptr"], po, plse, sl,
            *(plse if s is None else s for s in scales), scale,
            softcap * LOG2E, plan.window or 0, *q.stride(), *k_cache.stride(), *v_cache.stride(), *bt.stride(), *po.stride(),
            *plse.stride(),
            GROUP=group, GP=gp, BS=bs, D=d, BLOCK_M=bm, BLOCK_N=plan.node_block_n, BLOCK_D=block_d, IEEE=ieee,
            SOFTCAP=softcap > 0, FAST_TANH=fast_tanh(q), PDL=pdl, WINDOW=bool(plan.window), SCALED=scales[0] is not None,
            F16=fp8_mma_f16(q, k_cache),
            num_warps=_NODE_WARPS[bm], num_stages=3,
        )
        return bound and bound.lead(3)

    def tails(beside_prior=False):  # private tails: decode pieces that only write partial states
        view = tails_sm90_view(q, k_cache, v_cache, plan)
        if view is not None:  # Hopper, fp8: kernels/decode_sm90.py
            from paged_backend.kernels.decode_sm90 import pieces_sm90
            return pieces_sm90(q, k_cache, v_cache, bt, sl, out, lse, po, plse, v["leaf_work"], v["leaf_prog_ptr"],
                               plan.leaf_programs, -(-plan.leaf_programs // num_sms(q.device)), scale, scales, view,
                               pdl, softcap, beside_prior=beside_prior)
        return run_pieces(q, k_cache, v_cache, bt, sl, out, lse, po, plse, v["leaf_work"], v["leaf_prog_ptr"],
                          plan.leaf_programs, plan.block_n, scale, pdl, beside_prior=beside_prior, softcap=softcap,
                          scales=scales)

    if one_stream:
        # With PDL the tails start during the node kernel (they write other slots) and end after
        # it, and the merge starts during the tails: one stream, no launch gaps.
        relaunches = []
        if run_nodes:
            relaunches.append(nodes())
        if run_tails and not fused:
            relaunches.append(tails(beside_prior=bool(both)))
    else:
        # Node GEMMs and tail decode write disjoint slots and neither fills the memory system
        # alone: run them side by side, forked and joined on the stream (CUDA-graph capturable).
        main = torch.cuda.current_stream(q.device)
        if plan.side_stream is None:
            plan.side_stream = torch.cuda.Stream(q.device)
        plan.side_stream.wait_stream(main)
        with torch.cuda.stream(plan.side_stream):
            nodes()
        tails()
        main.wait_stream(plan.side_stream)
    # Per (request, kv_head): its slots, parents first and the tail last (fixed order).
    fold = fold_states(v["req_ptr"], po, plse, out, lse, hkv, pdl, slots=v["slots"], max_len=plan.max_merge_len,
                       sinks=sinks)
    if one_stream:
        remember(plan.launches, key, (*relaunches, fold))


def _merge_into(run_lse, run_o, idx, lse, o):
    """Merges states (lse [n, H], o [n, H, D], fp32) into rows ``idx`` of the running state."""
    a_l, a_o = run_lse[idx], run_o[idx]
    m = torch.maximum(a_l, lse)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(a_l - m_safe), torch.exp(lse - m_safe)
    ws = wa + wb
    empty = ws == 0
    den = torch.where(empty, torch.ones_like(ws), ws)
    run_o[idx] = (a_o * wa[..., None] + o * wb[..., None]) / den[..., None]
    run_lse[idx] = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(den))


def _attend(qg, k, v, live, scale, softcap):
    """qg [n, Hkv, g, D], k/v [n or 1, L, Hkv, D], live [n or 1, L] -> lse [n, Hkv*g], o [n, Hkv*g, D].
    The values of slots no row attends are zeroed first (in place: fresh gathers): they may hold
    NaN, and a zero weight times NaN is NaN. Their scores are masked."""
    if not live.all():
        if v.shape[0] == live.shape[0]:
            v[~live] = 0.0
        else:  # values shared by all rows
            v[:, ~live.any(0)] = 0.0
    s = torch.einsum("nhgd,mlhd->nhgl", qg, k) if k.shape[0] == 1 else torch.einsum("nhgd,nlhd->nhgl", qg, k)
    s = soft_cap(s * scale, softcap).masked_fill(~live[:, None, None, :], float("-inf"))
    l_ = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - l_.nan_to_num(neginf=0.0)[..., None])
    o = torch.einsum("nhgl,mlhd->nhgd", p, v) if v.shape[0] == 1 else torch.einsum("nhgl,nlhd->nhgd", p, v)
    n = qg.shape[0]
    return l_.reshape(n, -1), o.reshape(n, -1, qg.shape[-1])


def cascade_torch(q, k_cache, v_cache, plan, scale: float, out, lse, softcap: float = 0.0, sinks=None,
                  scales=(None, None)):
    """Vectorised torch version (CPU tensors), through the plan's node/tail decomposition: each
    node's K/V is gathered once and attended by all its requests; tails are gathered per request."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    run_lse = torch.full((b, hq), float("-inf"), dtype=torch.float32)
    run_o = torch.zeros(b, hq, d, dtype=torch.float32)
    bt = plan.views["block_table"].long().cpu()  # (the kernels' table: the host one may hold fewer blocks)
    qf = q.float().cpu()
    for (members, t0, t1), rep in zip(plan.nodes(), plan.node_reps().tolist()):
        mem = torch.from_numpy(members.astype("int64"))
        pages = bt[rep, t0 // bs: t1 // bs]
        k = dequantized(k_cache[pages].flatten(0, 1), scales[0])[None]  # [1, L, Hkv, D]
        vv = dequantized(v_cache[pages].flatten(0, 1), scales[1])[None]
        live = torch.ones(1, t1 - t0, dtype=torch.bool)
        if plan.window:  # each member's keys from its window's start
            live = torch.arange(t0, t1)[None, :] >= torch.from_numpy(plan.window_start()[members])[:, None]
        l_, o = _attend(qf[mem].view(-1, hkv, group, d), k, vv, live, scale, softcap)
        _merge_into(run_lse, run_o, mem, l_, o)
    starts = torch.from_numpy(plan.tail_start())
    lens = torch.from_numpy(plan.seq_lens_host.astype("int64"))
    tail = lens - starts
    max_t = int(tail.max()) if b else 0
    if max_t > 0:
        per = max(1, (1 << 24) // max(1, max_t * hkv * d))  # requests per chunk: bounds memory
        for c in range(0, b, per):
            ts, tl_ = starts[c:c + per], tail[c:c + per]
            pos = ts[:, None] + torch.arange(max_t)[None, :]
            live = torch.arange(max_t)[None, :] < tl_[:, None]
            col = torch.where(live, pos // bs, 0)
            pages = torch.where(live, torch.gather(bt[c:c + per], 1, col.clamp(max=bt.shape[1] - 1)), 0)
            rows = torch.where(live, pos % bs, 0)
            k = dequantized(k_cache[pages, rows], scales[0])  # [n, T, Hkv, D]
            vv = dequantized(v_cache[pages, rows], scales[1])
            l_, o = _attend(qf[c:c + per].view(-1, hkv, group, d), k, vv, live, scale, softcap)
            _merge_into(run_lse, run_o, torch.arange(c, c + l_.shape[0]), l_, o)
    sink_states(run_o, run_lse, sinks)
    out.copy_(run_o.to(out.dtype))
    lse.copy_(run_lse)


def runs_tails(plan, q: torch.Tensor) -> bool:
    """Whether the Hopper node kernel runs the plan's tails too, where it runs the plan's node pieces: plans
    with fused lists (``fused_prog_ptr``) of groups up to ``SM90_TAIL_GROUP``, queries that TMA reads (the
    tails take them so); else the decode kernel does."""
    return "fused_prog_ptr" in plan.views and plan.num_q_heads // plan.num_kv_heads <= SM90_TAIL_GROUP \
        and q_tma(q)


def tails_sm90_view(q, k_cache, v_cache, plan):
    """The caches' TMA view where the Hopper decode kernel runs the plan's tails (over fp8 caches, on plan terms
    only, so that an arena's plans launch alike: ``cascade.fused.hopper_tails``), else None (the portable
    decode kernel runs them)."""
    if k_cache.element_size() != 1 or not q_tma(q) or not hopper_tails(plan, 1):
        return None
    from paged_backend.kernels.ring_sm90 import covered
    return covered(q, k_cache, v_cache, fp8=True)


def node_sm90_config(q, k_cache, v_cache, plan, softcap: float, scales):
    """The Hopper node kernel's settings for this call, or None (the portable node kernel runs)."""
    if not use_sm90(q.device):
        return None
    from paged_backend.kernels.cascade_sm90 import node_sm90_config as config
    return config(q, k_cache, v_cache, plan, softcap, scales)
