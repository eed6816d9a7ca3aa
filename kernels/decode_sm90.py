"""Paged decode for Hopper (sm_90) over fp8 and 16-bit caches: the decode plan's pieces
(kernels/decode.py ``_decode_kernel``'s work rows and partial slots, so the fold runs unchanged) with
TMA page loads and wgmma, the keys as the GEMMs' M.

Why: the portable kernel over fp8 is bound by instructions, not bytes (H200, 2026-11-28: B8x32K
222.9 us, 57% of copy bandwidth, the same time as on an H100): per tile it computes every key's
address, converts each value in the GEMMs' register layout, and reads V byte by byte (its layout as
the GEMM's B operand runs along keys, the cache's along the head dimension). Over 16-bit caches it
pads a group of 4 query heads to 16 GEMM rows.

Here a loader warp streams K/V tiles of ``BLOCK_N`` keys, one TMA box per page (kernels/ring_sm90.py
``load_range``: no per-key addresses), and one consumer warpgroup runs both GEMMs "swapped":

- ``S^T [BLOCK_N, NQ] = K [BLOCK_N, D] @ Q^T [D, NQ]``: the group's ``GROUP`` query heads (padded to
  ``NQ`` >= 8, wgmma's smallest N) are the columns, so a group of 4 does not pay for 64 rows. An fp8
  K goes from its tile straight into wgmma's A registers (its rows run along D, as A's do), converted
  there (fp8 -> fp16 is exact; one conversion per two values); a 16-bit K tile is A as it is;
- ``O^T [D, NQ] += V^T [D, BLOCK_N] @ P^T [BLOCK_N, NQ]``: V's tile read transposed (as 16-bit
  operands may be); an fp8 V^T goes into wgmma's A registers like K, each thread reading 4-8
  contiguous head-dim bytes a key, the head dims relabelled in registers into A's rows
  (``attend_sm90.v_rows``: the output stored at their heads); P^T through a small shared tile.

The softmax runs down the columns of ``S^T`` (a maximum across the warpgroup's warps per tile); the
row sums are kept per element and reduced once at the piece's end. Over fp8, queries are fp16 as the
portable kernel takes them (``attend.mma_operand``: bf16 saturated to fp16's range), the
probabilities round to fp16, the scales fold into the scores' scale and the output; over 16-bit
caches everything is in the cache's dtype as in the portable kernel. Two programs share an SM, three
over fp8 (the plan's ``programs_per_sm``), each one consumer warpgroup and one loader warp. The loader
hands the consumer each piece's fields and queries (TMA boxes ``[1, NQ, D]`` of q): a piece's start
waits on no global load (the cascade's short tails run these partitions too).

H200, 2026-11-29 23:33 UTC, against the same plan on the portable kernel and FlashInfer in one run
(``benchmarks/results/h200.md`` "Paged decode"): fp8 B8x32K 225.3 -> 143.7 us eager, 140.4 us in a
graph (88%, 90% of copy bandwidth; three programs an SM); bf16 in a graph B64x4K 270.6 -> 250.8 us,
B1x32K 40.8 -> 38.9 us.
Probes (``benchmarks/results/sweeps/decode_fp8_sm90_h200.log``, ``decode_sm90_16bit_h200.log``), not
kept: an fp8 K through an fp16 tile too (200.5 us); P V left in flight across the next tile's scores
(ptxas serialized the wgmmas, C7514: 191.8 us); the loader reading a tile's page ids at once and the
next tile's ahead (no change); 3 fp8 stages instead of 4 (no change).
"""
from __future__ import annotations

import os

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from paged_backend.kernels.attend import LOG2E
from paged_backend.kernels.attend_sm90 import (attend_swapped, finish_swapped, fp16_operand, io_layout, sink_scale,
                                               swapped_layout, v_rows)
from paged_backend.kernels.ring_sm90 import (FIELDS, alloc_ring, descriptors, hand, hand_end, handed, load_q,
                                             load_range, q_descriptor)
from paged_backend.kernels.ring_sm90 import covered as covered_sm90  # (this module's covered adds the plan's terms)
from paged_backend.kernels.dispatch import SM90_DECODE_GROUP, q_tma
from paged_backend.kernels.launch import DescriptorRelaunch, launch

# (keys a K/V tile, ring stages of an fp8 cache at two programs an SM: half as many for 16-bit ones,
# the same bytes); PAGED_BACKEND_DECODE_SM90_TILE=KEYSxSTAGES sets them (a sweep)
TILE = tuple(int(x) for x in os.environ.get("PAGED_BACKEND_DECODE_SM90_TILE", "64x4").split("x"))
# Registers a thread by programs an SM (a program: 8 warps, the loader's padding a warpgroup), so that
# every program of a plan is resident at once; plans of 3+ an SM (fp8 plans, decode_plan.py) also
# halve the ring (shared memory). At 3 an SM: 80, where groups up to 16 spill nothing (72 measured 1-2%
# faster at group 4 with 8 bytes of spills, and spills 108 at group 16: H200, sweeps
# decode_fp8_programs_h200.log; tests/test_kernels_compile.py).
MAXNREG = {1: 128, 2: 128, 3: 80, 4: 64}
# Plans with fewer tiles a program take the portable kernel: their eager calls are bound by the host,
# where this kernel's launch (TMA descriptors) costs ~7 us more (H200 probe, 2026-11-29, sweeps
# decode_sm90_16bit_h200.log: bf16 B1x8K, 3.9 tiles a program, 43.6 against 36.0 us eager, 16.4
# against 17.0 us in a graph).
MIN_TILES_PER_PROGRAM = 8


@gluon.jit
def _piece(pieces, p):
    """Piece ``p`` of the plan -> (request, kv_head, token_start, token_end, slot): its end bounded by the
    request's device length and the table's capacity, as the portable kernel bounds it (a plan made
    from upper bounds stays exact; no page id past the table is read)."""
    work_ptr, _, seq_lens_ptr, stride_sl, max_tokens = pieces
    w = work_ptr + p * 5  # (request, kv_head, token_start, token_end, slot)
    b = gl.load(w).to(gl.int64)
    end = gl.minimum(gl.minimum(gl.load(w + 3), max_tokens), gl.load(seq_lens_ptr + b * stride_sl))
    return b, gl.load(w + 1), gl.load(w + 2), end, gl.load(w + 4)


@gluon.jit
def consumer(rows, smem, GROUP: gl.constexpr, NQ: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, SOFTCAP: gl.constexpr, SINKS: gl.constexpr, PARTIAL: gl.constexpr):
    """One warpgroup: every piece the loader hands, in order, into ``out``/``lse`` or its partial slot
    (``SINKS``: the sinks join the states written to ``out``/``lse``; the fold adds them to the others;
    ``PARTIAL``: every piece has a slot - a cascade's tails, kernels/cascade_sm90.py - and no output is written).
    A piece's fields and queries come from the loader with its first K tile: nothing it needs is a global load
    away (H200 A/B of ours: 4096/256/128's cascade 67.1 -> 62.7 us in graphs; sweeps/decode_q_handoff_h200.log)."""
    (out_ptr, lse_ptr, po_ptr, plse_ptr, ks_ptr, vs_ptr, sinks_ptr, sm_scale, cap, stride_ob, stride_oh, stride_lb,
     stride_lh, stride_pop, stride_poh, stride_plp, stride_plh) = rows
    q_smem, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, slots, q_ring, q_ready, q_empty = smem
    s_layout: gl.constexpr = swapped_layout(NQ)
    F8: gl.constexpr = k_smem.dtype.is_fp8()
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    v_scale = 1.0
    if F8:  # the cache's scales: k's folds into the scores' scale, v's into the output
        qk_scale = qk_scale * gl.load(ks_ptr)
        v_scale = gl.load(vs_ptr)
    h = gl.arange(0, NQ, layout=gl.SliceLayout(0, s_layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(1, s_layout))
    if F8:  # acc's rows are V^T's as attend_swapped relabelled them: stored at their head dims
        d = v_rows(d, D)
    ok = h < GROUP
    it = gl.to_tensor(0)
    n = gl.to_tensor(0)  # pieces so far (Q buffer n % 2)
    b, kvh, start, end, slot, _, n_tiles, _ = handed(slots, k_ready, it, STAGES)
    while n_tiles > 0:
        mbarrier.wait(q_ready.index(n % 2), (n // 2) & 1)
        if F8:  # fp16 operands (attend.mma_operand): the queries saturated to fp16's range
            q_tile = q_smem
            q_tile.store(fp16_operand(q_ring.index(n % 2).load(io_layout())))
            fence_async_shared()
            # The box is released once its values are stored: a release right after the loads let the loader's
            # next TMA into the box land before every load had read it (the barrier before an arrive does not
            # wait for loads in flight) - wrong queries in a few pieces a call where the loader ran two short
            # pieces ahead (sweeps/cascade_fp8_sm90_h200.log section 7).
            mbarrier.arrive(q_empty.index(n % 2), count=1)
        else:
            q_tile = q_ring.index(n % 2)
        acc, m_i, l_i = attend_swapped(q_tile, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, it,
                                       n_tiles, (end - start) // BLOCK_N, start, end, qk_scale, cap, D, NQ, BLOCK_N,
                                       STAGES, SOFTCAP)
        if not F8:
            mbarrier.arrive(q_empty.index(n % 2), count=1)
        it += n_tiles
        n += 1
        o, lse = finish_swapped(acc, m_i, l_i, v_scale)
        if PARTIAL:
            _store_partial(rows, slot, o, lse, h, d, ok)
        elif slot < 0:  # the segment's only piece: the output itself
            qh = (kvh * GROUP + h).to(gl.int64)
            if SINKS:  # a key of logit sinks[h] and value 0: only the denominator grows
                factor, lse = sink_scale(lse, gl.load(sinks_ptr + qh, mask=ok, other=0.0))
                o = o * factor[None, :]
            b64 = b.to(gl.int64)
            gl.store(out_ptr + b64 * stride_ob + qh[None, :] * stride_oh + d[:, None],
                     o.to(out_ptr.dtype.element_ty), mask=ok[None, :])
            gl.store(lse_ptr + b64 * stride_lb + qh * stride_lh, lse, mask=ok)
        else:
            _store_partial(rows, slot, o, lse, h, d, ok)
        b, kvh, start, end, slot, _, n_tiles, _ = handed(slots, k_ready, it, STAGES)


@gluon.jit
def _store_partial(rows, slot, o, lse, h, d, ok):
    """A piece's state ``o [D, NQ]``, ``lse [NQ]`` into its partial slot (heads ``h``, ``ok``: real ones)."""
    po_ptr, plse_ptr = rows[2], rows[3]
    stride_pop, stride_poh, stride_plp, stride_plh = rows[13:]
    at = slot.to(gl.int64)
    gl.store(po_ptr + at * stride_pop + h[None, :] * stride_poh + d[:, None], o, mask=ok[None, :])
    gl.store(plse_ptr + at * stride_plp + h * stride_plh, lse, mask=ok)


@gluon.jit
def loader(k_desc, v_desc, q_desc, bt_ptr, pieces, smem, stride_btb, stride_btn, page_rows, head_rows, head_cols,
           oob_row, GROUP: gl.constexpr, BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr,
           STAGES: gl.constexpr):
    """One warp: every piece of this program, in order - its fields to the consumer, its queries (``q_desc``:
    ``[1, NQ, D]`` boxes, the rows past the group its neighbours' or zeros, never stored) and its K/V tiles."""
    k_smem, v_smem = smem[1], smem[2]
    k_ready, v_ready, k_empty, v_empty, slots, q_ring, q_ready, q_empty = smem[4:]
    prog_ptr = pieces[1]
    g = gl.program_id(0)
    it = gl.to_tensor(0)
    n = gl.to_tensor(0)
    for p in range(gl.load(prog_ptr + g), gl.load(prog_ptr + g + 1)):
        b, kvh, start, end, slot = _piece(pieces, p)
        n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)
        load_q((q_desc, q_ring, q_ready, q_empty), n, (b.to(gl.int32), kvh * GROUP, 0))
        n += 1
        hand(slots, k_ready, k_empty, it, (b.to(gl.int32), kvh, start, end, slot, 0, n_tiles, 0), STAGES)
        it = load_range(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles,
                        bt_ptr + b * stride_btb, stride_btn, start, end, kvh, kvh * head_cols, page_rows, head_rows,
                        oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)
    hand_end(slots, k_ready, k_empty, it, STAGES)


@gluon.jit
def alloc_smem(q_desc, k_desc, v_desc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Shared memory of :func:`loader` and :func:`consumer`: the K/V ring of ``STAGES`` and :func:`_alloc_hand`'s.
    -> the ``smem`` tuple both take."""
    F8: gl.constexpr = k_desc.dtype.is_fp8()
    op: gl.constexpr = gl.float16 if F8 else k_desc.dtype  # the GEMMs' operand dtype
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_ring(k_desc, v_desc, BLOCK_N, STAGES, 1)
    q_smem, p_smem, slots, q_ring, q_ready, q_empty = _alloc_hand(q_desc, op, BLOCK_N, STAGES, F8)
    return q_smem, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, slots, q_ring, q_ready, q_empty


@gluon.jit
def _alloc_hand(q_desc, op: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, F8: gl.constexpr):
    """Shared memory of :func:`loader` and :func:`consumer` but the K/V ring: the queries' tile (``op``), P's
    tile, two query boxes as they come (the tile itself, but over ``F8`` caches, where the consumer converts
    them) and their barriers, a slot of fields a ring stage. -> (q_smem, p_smem, slots, q_ring, q_ready, q_empty)."""
    NQ: gl.constexpr = q_desc.block_type.shape[1]
    D: gl.constexpr = q_desc.block_type.shape[2]
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [2, NQ, D], gl.NVMMASharedLayout.get_default_for([NQ, D],
                                                                                                     q_desc.dtype))
    if F8:
        q_smem = gl.allocate_shared_memory(op, [NQ, D], gl.NVMMASharedLayout.get_default_for([NQ, D], op))
    else:
        q_smem = q_ring  # (not used: the boxes are the operand)
    p_smem = gl.allocate_shared_memory(op, [NQ, BLOCK_N], gl.NVMMASharedLayout.get_default_for([NQ, BLOCK_N], op))
    slots = gl.allocate_shared_memory(gl.int32, [STAGES, FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(q_ready.index(j), count=1)
        mbarrier.init(q_empty.index(j), count=1)
    return q_smem, p_smem, slots, q_ring, q_ready, q_empty


@gluon.jit
def _decode_sm90_kernel(
    q_desc, k_desc, v_desc, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,  # a call's own arguments first (relaunch)
    work_ptr, prog_ptr, po_ptr, plse_ptr, ks_ptr, vs_ptr, sinks_ptr, sm_scale, cap, max_tokens, page_rows, head_rows,
    head_cols, oob_row, stride_sl, stride_btb, stride_btn, stride_ob, stride_oh, stride_lb, stride_lh, stride_pop,
    stride_poh, stride_plp, stride_plh,
    GROUP: gl.constexpr, NQ: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
    PAGE_BOX: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, SOFTCAP: gl.constexpr, SINKS: gl.constexpr,
    WAIT_AT_END: gl.constexpr,
):
    """``WAIT_AT_END``: launched beside the kernel before it (a cascade's tails beside its node pieces), the grid
    ends only after that one, so that the fold's wait covers both."""
    if PDL:  # the fold may launch now: it waits for this grid's writes
        gdc_launch_dependents()
    smem = alloc_smem(q_desc, k_desc, v_desc, BLOCK_N, STAGES)
    rows = (out_ptr, lse_ptr, po_ptr, plse_ptr, ks_ptr, vs_ptr, sinks_ptr, sm_scale, cap, stride_ob, stride_oh,
            stride_lb, stride_lh, stride_pop, stride_poh, stride_plp, stride_plh)
    pieces = (work_ptr, prog_ptr, seq_lens_ptr, stride_sl, max_tokens)
    gl.warp_specialize([
        (consumer, (rows, smem, GROUP, NQ, D, BLOCK_N, STAGES, SOFTCAP, SINKS, False)),
        (loader, (k_desc, v_desc, q_desc, bt_ptr, pieces, smem, stride_btb, stride_btn, page_rows, head_rows,
                  head_cols, oob_row, GROUP, BS, BLOCK_N, PAGE_BOX, STAGES)),
    ], [1], [24])
    if WAIT_AT_END:
        gdc_wait()


def covered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan):
    """The TMA view of the caches when this kernel runs the call, else None (the portable kernel
    does): what ``ring_sm90.covered`` takes over a cache of the queries' dtype or fp8, with a group of
    at most 16 (the accumulators of larger ones spill in the two-programs-an-SM register budget), a
    plan without a window cut at multiples of the tile with at least ``MIN_TILES_PER_PROGRAM`` tiles a
    program, queries TMA can read (soft-capping and sinks are the kernel's own: :func:`decode_sm90` takes them)."""
    if plan.window or plan.block_n % TILE[0] or not q_tma(q):
        return None
    if q.shape[-2] // k_cache.shape[2] > SM90_DECODE_GROUP:
        return None
    tiles = int(np.maximum(-(-plan.seq_lens_host // plan.block_n), 1).sum()) * k_cache.shape[2]
    if tiles < MIN_TILES_PER_PROGRAM * plan.num_programs:
        return None
    return covered_sm90(q, k_cache, v_cache, fp8=k_cache.element_size() == 1)


def decode_sm90(q, k_cache, v_cache, block_table, seq_lens, out, lse, plan, scale: float, scales, view,
                pdl: bool, softcap: float = 0.0, sinks=None):
    """The plan's pieces (``covered`` gave ``view``) into ``out``/``lse`` and the plan's partial slots;
    ``scales``: an fp8 cache's ``(k_scale, v_scale)`` ``[1]`` fp32 tensors, or ``(None, None)``;
    ``softcap`` > 0 soft-caps the scores; ``sinks [Hq]`` fp32 (or None) join the states written to
    ``out``/``lse`` (the fold's ``sinks`` the folded ones). -> a relaunch taking the addresses of (q,
    k_cache, v_cache, block_table, seq_lens, out, lse), or None."""
    return pieces_sm90(q, k_cache, v_cache, block_table, seq_lens, out, lse, plan.partial_o, plan.partial_lse,
                       plan.work, plan.prog_ptr, plan.num_programs, plan.programs_an_sm, scale, scales, view, pdl,
                       softcap, sinks)


def pieces_sm90(q, k_cache, v_cache, block_table, seq_lens, out, lse, partial_o, partial_lse, work, prog_ptr,
                num_programs: int, per_sm: int, scale: float, scales, view, pdl: bool, softcap: float = 0.0,
                sinks=None, beside_prior: bool = False):
    """:func:`decode_sm90` over any pieces ``work [P, 5]`` (``prog_ptr [num_programs + 1]``: each program's),
    ``per_sm`` programs an SM (its registers and ring); ``beside_prior`` (with PDL): the kernel before it on the
    stream neither feeds nor reads these pieces (a cascade's tails beside its node pieces), so they start while it
    runs and the grid ends after it, as ``kernels/decode.py run_pieces`` launches them."""
    hq, d = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    per_sm = min(per_sm, 4)
    beside_prior = beside_prior and pdl
    block_n, stages = TILE[0], TILE[1] // (1 if per_sm <= 2 else 2)
    stages = max(1, stages // k_cache.element_size())  # 16-bit: the same bytes in flight
    box = min(bs, block_n)
    nq = max(8, group)
    bound = launch(
        _decode_sm90_kernel, (num_programs,), q_descriptor(q, (1, nq, d)),
        *descriptors(k_cache, v_cache, view, box, block_n),
        block_table, seq_lens, out, lse, work, prog_ptr, partial_o, partial_lse,
        *(q if x is None else x for x in scales),  # (16-bit: not read)
        lse if sinks is None else sinks, scale, softcap * LOG2E, block_table.shape[1] * bs, *view[2:], view[0],
        seq_lens.stride(0), *block_table.stride(), out.stride(0), out.stride(1),
        *lse.stride(), partial_o.stride(0), partial_o.stride(1), *partial_lse.stride(),
        GROUP=group, NQ=nq, BS=bs, D=d, BLOCK_N=block_n, PAGE_BOX=box, STAGES=stages, PDL=pdl,
        SOFTCAP=softcap > 0, SINKS=sinks is not None, WAIT_AT_END=beside_prior, num_warps=4,
        maxnreg=MAXNREG[per_sm], **({"launch_pdl": True} if beside_prior else {}))
    return bound and DescriptorRelaunch(bound, 7)
