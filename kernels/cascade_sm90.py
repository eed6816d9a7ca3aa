"""The cascade node kernel for Hopper (sm_90): the node pieces of a ``CascadePlan`` with TMA page loads
and warp-specialised wgmma (kernels/ring_sm90.py, kernels/attend_sm90.py), writing the same partial states as
``_cascade_node_kernel`` (kernels/cascade.py), which the fold then uses unchanged.

A piece = (node, KV head, row block of 128 rows, token range): its rows are ``128 // GP`` member
requests x ``GP`` query heads (the plan's ``block_m`` of 128), two consumer warpgroups of 64 rows
each; the loader warp streams the range's K/V tiles (64 keys, three stages: ``node_sm90_config``).
Programs are persistent over the plan's piece lists (``node_prog_ptr``), and loader and consumers
count ring tiles across pieces. Piece ranges start on a page or on a multiple of the plan's
``node_block_n`` (64) inside a node whose keys are whole shared pages, so page boxes of
``min(BS, 64)`` rows never straddle a page, and boxes past a range's end load zeros.

``TAILS``: the program runs the plan's private tails too, beside its node pieces: the tail pieces
``fused_prog_ptr[g] ..`` (paged_backend/cascade/partition.py: the tails cut stream-K over the node grid)
run on the Hopper decode's swapped pipeline (kernels/decode_sm90.py: a third consumer warpgroup and a
second loader warp, with their own ring of 64-key tiles), so that an SM streams tails (bound by memory)
while its node GEMMs run (bound by the tensor cores), and the decode kernel does not run. A program
running its node pieces and then its tails, one after the other, took their sum (ncu: DRAM 8% busy
during the node GEMMs of 4096/256/128); side by side, H200 2026-11-30 (bench_cascade, eager): 8192/64/256
44.6 -> 39.6 us, 4096/256/128 81.6 -> 68.9, 32768/256/256 331.4 -> 287.1
(``benchmarks/results/sweeps/cascade_tails_beside_h200.log``).

Over an fp8 cache, converter warps beside the loader turn its fp8 tiles into fp16 ones for the node consumers
(``ring_sm90.convert_range``), as in the Hopper prefill. With ``TAILS`` (plans whose node GEMMs are short:
``CascadeCost.fp8_fused_flops``) the tails' consumer converts its own (the decode kernel's fp8 path) and takes
registers and shared memory from the node side (``F8_TAIL_REGS``): H200, 2026-11-30, against the tails on the
decode kernel after the node kernel, 8192/64/256 53.7 -> 47.5 us, 4096/64/128 39.6 -> 33-38, but 32768/64/32
101 -> 119 (``benchmarks/results/sweeps/cascade_fp8_sm90_h200.log`` section 6; 98 once the converter loaded a
chunk ahead, section 9). Other fp8 plans' tails run on the
Hopper decode kernel, launched beside this one with PDL (kernels/cascade.py ``tails_sm90_view``), which finds no
room on its SMs until it ends.

As the portable node kernel, it lets the next kernel launch at once (PDL), and the plan replays it on
later calls through a ``DescriptorRelaunch`` (kernels/launch.py): Gluon's launch path with its
descriptors costs far more host time than the kernel takes on short nodes.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from triton.language.extra.cuda import gdc_launch_dependents

from paged_backend.kernels.attend import LOG2E
from paged_backend.kernels.attend_sm90 import (ROWS, alloc_rings, attend_tiles, finish_state, io_layout, load_rows,
                                               mma_layout)
from paged_backend.kernels.ring_sm90 import (CONVERT_REGS, alloc_ring, alloc_ring_of, convert_range, covered,
                                             descriptors, load_range, q_descriptor, release_tiles)
from paged_backend.kernels.decode_sm90 import alloc_smem, consumer as tail_consumer, loader as tail_loader
from paged_backend.kernels.launch import DescriptorRelaunch, launch

NODE_BLOCK_M = 128  # the plan tile the kernel takes: CONSUMERS x ROWS rows
# (keys a K/V tile, ring stages): see node_sm90_config; PAGED_BACKEND_NODE_TILE=KEYSxSTAGES sets them (a sweep)
NODE_TILE = tuple(int(x) for x in os.environ.get("PAGED_BACKEND_NODE_TILE", "64x3").split("x"))
# The tails' ring (64-key tiles x 2 stages: 200 KB of shared memory a program with the node ring) and the
# registers a thread of the second node warpgroup, the tails' consumer and the two loaders take (the first node
# warpgroup takes what is left of 512: 184). Fewer for either node warpgroup or the tails' consumer spill; as
# set, one lane index that the compiler hoists into the prologue (tests/test_kernels_compile.py).
TAIL_STAGES = 2
TAIL_REGS = gl.constexpr([200, 104, 24, 24])
# Over fp8 caches the tails' consumer is the first partition (it reads the kernel's arguments where it uses them: a
# worker keeps them in registers) and takes what is left of 512 registers a thread: 112, where it spills nothing
# (it converts K in registers as the decode kernel does, which gives its consumer 136). Then [the two node
# warpgroups, the two loaders, the node tiles' converter warps]: loaders and converters share a warpgroup, so
# one count for the four warps, 32, at which the converters turn F8_TAIL_CHUNK rows at a time (a whole tile at
# once needs 112, which would leave the node warpgroups under 184, where they spill). The node ring's fp8 tiles
# land in TAIL_STAGES stages (216 KB of shared memory in all).
F8_TAIL_REGS = gl.constexpr([184, 184, 32, 32, 32])
F8_TAIL_CHUNK = gl.constexpr(8)


@gluon.jit
def _piece(work_ptr, p):
    """Node piece ``p`` -> (rep request, kv_head, member base, members, token_start, token_end, slot base)."""
    w = work_ptr + p * 7
    return gl.load(w), gl.load(w + 1), gl.load(w + 2), gl.load(w + 3), gl.load(w + 4), gl.load(w + 5), gl.load(w + 6)


@gluon.jit
def _node_load_partition(args, BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr,
                         STAGES: gl.constexpr):
    """One warp: the K/V tiles of every node piece of this program, in order (``args``: the caches' descriptors,
    their ring, the pieces, the block table and the caches' TMA view)."""
    k_desc, v_desc, ring, pieces, bt_ptr, stride_btb, stride_btn, page_rows, head_rows, head_cols, oob_row = args
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = ring
    work_ptr, prog_ptr = pieces
    g = gl.program_id(0)
    it = gl.to_tensor(0)  # ring tiles so far (a tensor: it is carried through the loop)
    for p in range(gl.load(prog_ptr + g), gl.load(prog_ptr + g + 1)):
        rep, kvh, _, _, start, end, _ = _piece(work_ptr, p)
        bt_row_ptr = bt_ptr + rep.to(gl.int64) * stride_btb
        it = load_range(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it,
                        gl.maximum(gl.cdiv(end - start, BLOCK_N), 1), bt_row_ptr, stride_btn, start, end, kvh,
                        kvh * head_cols, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)


@gluon.jit
def _node_consumer_partition(rows, pieces, WG: gl.constexpr, GROUP: gl.constexpr, GP: gl.constexpr, D: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
                             scales=None, F8: gl.constexpr = False):
    """One warpgroup: rows ``WG * ROWS ..`` of each node piece (members x ``GP`` heads) -> partial slots;
    a piece without such rows only has its tiles released. (Node ranges end on a page, so no tile needs
    its V rows zeroed: boxes past a range's end load zeros.)

    The partial states are stored from the accumulator's own layout, not converted to rows of 16
    bytes first: the conversion (through shared memory, with warpgroup barriers) sat between each
    piece's GEMMs and the next piece's. The stores ask the L2 to keep the states (``evict_last``),
    which the fold reads back after the tails have streamed through it.
    H100, 2026-11-26 (tail pieces then ran on these warpgroups too): 8192/64/256 63.3 -> 60.3 us,
    4096/256/128 95.3 -> 91.1 us (of which the eviction hint 1 and 0 us), 131072/8/1024 213.4 -> 215.1 us
    (``benchmarks/results/sweeps/cascade_consumer_sm90_h100.log``)."""
    (q_ptr, members_ptr, po_ptr, plse_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
     v_empty, stride_qb, stride_qh, stride_pop, stride_poh, stride_plp, stride_plh, sm_scale, cap) = rows
    work_ptr, prog_ptr = pieces
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    if F8:  # the converter's fp16 tiles of an fp8 cache: k's scale folds into the scores' scale, v's into the states
        qk_scale = qk_scale * gl.load(scales[0])
        v_scale = gl.load(scales[1])
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    loc_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout()))
    loc_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    loc_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    q_tile = q_smem.index(WG)
    head = loc_io % GP  # query head of each row (GP divides ROWS)
    m0: gl.constexpr = WG * ROWS // GP  # the consumer's first member in a piece's row block
    g = gl.program_id(0)
    it = gl.to_tensor(0)
    for p in range(gl.load(prog_ptr + g), gl.load(prog_ptr + g + 1)):
        _, kvh, mbase, n_in, start, end, slot_base = _piece(work_ptr, p)
        n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)
        if m0 < n_in:
            mem = m0 + loc_io // GP  # member (within the piece's row block) of each row
            mem_s = m0 + loc_s // GP
            ok = (mem < n_in) & (head < GROUP)
            req = gl.load(members_ptr + mbase + mem, mask=mem < n_in, other=0).to(gl.int64)
            load_rows(q_tile, q_ptr, req, kvh * GROUP + head, ok, stride_qb, stride_qh, D)
            acc, m_i, l_i = attend_tiles(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles,
                                         (end - start) // BLOCK_N, start, end, loc_s, qk_scale, cap, D, BLOCK_N,
                                         STAGES, False, False, SOFTCAP, False)
            o, lse = finish_state(acc, m_i, l_i)  # [ROWS, D] in the accumulator's layout, [ROWS] in the scores'
            if F8:
                o = o * v_scale
            mem_o = m0 + loc_o // GP
            ok_o = (mem_o < n_in) & (loc_o % GP < GROUP)
            gl.store(po_ptr + (slot_base + mem_o).to(gl.int64)[:, None] * stride_pop +
                     (loc_o % GP)[:, None] * stride_poh + d_o[None, :], o, mask=ok_o[:, None],
                     eviction_policy="evict_last")
            ok_s = (mem_s < n_in) & (loc_s % GP < GROUP)
            gl.store(plse_ptr + (slot_base + mem_s).to(gl.int64) * stride_plp + (loc_s % GP) * stride_plh, lse,
                     mask=ok_s, eviction_policy="evict_last")
        else:
            release_tiles(k_ready, v_ready, k_empty, v_empty, it, n_tiles, STAGES)
        it += n_tiles


@gluon.jit
def _node_convert_partition(k_rings, v_rings, pieces, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr):
    """Warps turning an fp8 cache's node tiles into the consumers' fp16 tiles (:func:`ring_sm90.convert_range`),
    piece by piece as the loader walks them."""
    work_ptr, prog_ptr = pieces
    g = gl.program_id(0)
    it = gl.to_tensor(0)
    for p in range(gl.load(prog_ptr + g), gl.load(prog_ptr + g + 1)):
        _, _, _, _, start, end, _ = _piece(work_ptr, p)
        it = convert_range(k_rings, v_rings, it, gl.maximum(gl.cdiv(end - start, BLOCK_N), 1), CHUNK)


@gluon.jit
def _cascade_node_sm90_kernel(
    q_ptr, k_desc, v_desc, t_q, bt_ptr, members_ptr, work_ptr, prog_ptr, leaf_ptr, tail_prog_ptr, seq_lens_ptr,
    po_ptr, plse_ptr, k_scale_ptr, v_scale_ptr, sm_scale, cap, max_tokens, page_rows, head_rows, head_cols, oob_row,
    stride_qb, stride_qh, stride_btb, stride_btn, stride_sl, stride_pop, stride_poh, stride_plp, stride_plh,
    GROUP: gl.constexpr, GP: gl.constexpr, NQ: gl.constexpr, BS: gl.constexpr, D: gl.constexpr,
    BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr, STAGES: gl.constexpr, TAIL_STAGES: gl.constexpr,
    PDL: gl.constexpr, TAILS: gl.constexpr, SOFTCAP: gl.constexpr,
):
    """``t_q``: the queries again, as the tails read them: a TMA descriptor (``TAILS``; else not read). Over an
    fp8 cache the loader lands the node tiles in a ring of their own and converter warps make the consumers' fp16
    tiles."""
    if PDL:  # the tails or the merge may launch now: they wait for this grid where they must
        gdc_launch_dependents()
    # Row strides are >= 0 (torch's): their 64-bit products need no sign words, which the compiler would otherwise
    # compute before the partitions and carry into them (spilled there; the node consumers read q's strides).
    gl.assume(stride_qb >= 0)
    gl.assume(stride_btb >= 0)
    gl.assume(stride_sl >= 0)
    gl.assume(stride_pop >= 0)
    gl.assume(stride_plp >= 0)
    F8: gl.constexpr = k_desc.dtype.is_fp8()
    if F8:  # fp16 operands, as the portable kernel's (attend.mma_operand)
        q_smem = gl.allocate_shared_memory(gl.float16, [2, ROWS, D],
                                           gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.float16))
        tile16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float16)
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_ring_of(gl.float16, tile16, BLOCK_N, D, STAGES, 2)
        # the tiles as they land: as many stages, or with the tails' ring beside them 2 (shared memory)
        LAND: gl.constexpr = TAIL_STAGES if TAILS else STAGES
        k8, v8, k8_ready, v8_ready, k8_empty, v8_empty = alloc_ring(k_desc, v_desc, BLOCK_N, LAND, 1)
        node_ring = (k8, v8, k8_ready, v8_ready, k8_empty, v8_empty)
    else:
        q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_rings(k_desc, v_desc, D, BLOCK_N, STAGES)
        LAND: gl.constexpr = STAGES
        node_ring = (k_smem, v_smem, k_ready, v_ready, k_empty, v_empty)
    rows = (q_ptr, members_ptr, po_ptr, plse_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
            v_empty, stride_qb, stride_qh, stride_pop, stride_poh, stride_plp, stride_plh, sm_scale, cap)
    pieces = (work_ptr, prog_ptr)
    scales = (k_scale_ptr, v_scale_ptr)
    node_loader_args = (k_desc, v_desc, node_ring, pieces, bt_ptr, stride_btb, stride_btn, page_rows, head_rows,
                        head_cols, oob_row)
    if F8:
        rings = (((k8, k8_ready, k8_empty), (k_smem, k_ready, k_empty)),
                 ((v8, v8_ready, v8_empty), (v_smem, v_ready, v_empty)))
    if TAILS:  # the Hopper decode's consumer and loader over the program's tail pieces, on a ring of their own
        t_smem = alloc_smem(t_q, k_desc, v_desc, BLOCK_N, TAIL_STAGES)
        # (tails write partial slots only: the output and sinks are not read)
        t_rows = (po_ptr, plse_ptr, po_ptr, plse_ptr, k_scale_ptr, v_scale_ptr, plse_ptr, sm_scale, cap, stride_pop,
                  stride_poh, stride_plp, stride_plh, stride_pop, stride_poh, stride_plp, stride_plh)
        t_pieces = (leaf_ptr, tail_prog_ptr, seq_lens_ptr, stride_sl, max_tokens)
        if F8:
            gl.warp_specialize([
                (tail_consumer, (t_rows, t_smem, GROUP, NQ, D, BLOCK_N, TAIL_STAGES, SOFTCAP, False, True)),
                (_node_consumer_partition, (rows, pieces, 0, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP, scales, F8)),
                (_node_consumer_partition, (rows, pieces, 1, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP, scales, F8)),
                (_node_load_partition, (node_loader_args, BS, BLOCK_N, PAGE_BOX, LAND)),
                (tail_loader, (k_desc, v_desc, t_q, bt_ptr, t_pieces, t_smem, stride_btb, stride_btn, page_rows,
                               head_rows, head_cols, oob_row, GROUP, BS, BLOCK_N, PAGE_BOX, TAIL_STAGES)),
                (_node_convert_partition, (rings[0], rings[1], pieces, BLOCK_N, F8_TAIL_CHUNK)),
            ], [4, 4, 1, 1, 2], F8_TAIL_REGS)
        else:
            gl.warp_specialize([
                (_node_consumer_partition, (rows, pieces, 0, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP)),
                (_node_consumer_partition, (rows, pieces, 1, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP)),
                (tail_consumer, (t_rows, t_smem, GROUP, NQ, D, BLOCK_N, TAIL_STAGES, SOFTCAP, False, True)),
                (_node_load_partition, (node_loader_args, BS, BLOCK_N, PAGE_BOX, LAND)),
                (tail_loader, (k_desc, v_desc, t_q, bt_ptr, t_pieces, t_smem, stride_btb, stride_btn, page_rows,
                               head_rows, head_cols, oob_row, GROUP, BS, BLOCK_N, PAGE_BOX, TAIL_STAGES)),
            ], [4, 4, 1, 1], TAIL_REGS)
    elif F8:
        gl.warp_specialize([
            (_node_consumer_partition, (rows, pieces, 0, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP, scales, F8)),
            (_node_consumer_partition, (rows, pieces, 1, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP, scales, F8)),
            (_node_load_partition, (node_loader_args, BS, BLOCK_N, PAGE_BOX, LAND)),
            (_node_convert_partition, (rings[0], rings[1], pieces, BLOCK_N, 0)),
        ], [4, 1, 2], CONVERT_REGS)
    else:
        gl.warp_specialize([
            (_node_consumer_partition, (rows, pieces, 0, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP)),
            (_node_consumer_partition, (rows, pieces, 1, GROUP, GP, D, BLOCK_N, STAGES, SOFTCAP)),
            (_node_load_partition, (node_loader_args, BS, BLOCK_N, PAGE_BOX, LAND)),
        ], [4, 1], [240, 24])


def node_sm90_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan, softcap: float,
                     scales) -> dict | None:
    """The Hopper node kernel's settings for a plan's node pieces, or None (the portable node kernel
    runs; the caller checked the device): what ``ring_sm90.covered`` covers, a plan tile of 128
    rows and node ranges cut at multiples of 64 keys, no window (soft-capped or not; over an fp8 cache with its
    ``scales``: ``fp8``). (Its node pieces read the queries by pointer; its tails only by TMA:
    ``kernels/cascade.py runs_tails``.)

    Tiles of 64 keys in three stages, where the prefill kernel takes 128 x 2: node pieces are short
    (a few dozen tiles) and tail pieces shorter, and finer stages keep more of them in flight (H100,
    2026-11-26: 8192/64/256 72.1 -> 66.0 us, 4096/256/128 120.2 -> 115.8 us; four stages of 64 and
    the prefill with 64-key tiles were slower; ``results/sweeps/cascade_fused_sm90_h100.log``)."""
    if plan.window or plan.block_m != NODE_BLOCK_M or plan.node_block_n % 64:
        return None
    fp8 = k_cache.element_size() == 1
    view = covered(q, k_cache, v_cache, fp8)
    if view is None:
        return None
    block_n, stages = NODE_TILE
    return dict(block_n=block_n, page_box=min(k_cache.shape[1], 64), stages=stages, view=view, softcap=softcap,
                scales=scales, fp8=fp8)


def cascade_nodes_sm90(q, k_cache, v_cache, plan, scale: float, cfg: dict, pdl: bool, tails: bool):
    """The plan's node pieces into its partial slots (``plan.partial_o`` / ``partial_lse``), and with
    ``tails`` (the plan has ``fused_prog_ptr``) its tail pieces too. -> a relaunch of it taking the
    addresses of (q, k_cache, v_cache), or None (as ``launch(...).lead(3)``)."""
    hq, d = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    v, view = plan.views, cfg["view"]
    bt, sl, po, plse = v["block_table"], v["seq_lens"], plan.partial_o, plan.partial_lse
    grid = (plan.node_programs,)
    nq = max(8, group)
    args = (q, *descriptors(k_cache, v_cache, view, cfg["page_box"], cfg["block_n"]),
            q_descriptor(q, (1, nq, d)) if tails else q, bt, v["members"],
            v["node_work"], v["node_prog_ptr"], v["leaf_work"], v["fused_prog_ptr" if tails else "node_prog_ptr"],
            sl, po, plse, *(plse if x is None else x for x in cfg["scales"]),  # (16-bit caches: not read)
            scale, cfg["softcap"] * LOG2E, bt.shape[1] * bs, *view[2:], view[0],
            q.stride(0), q.stride(1), *bt.stride(), sl.stride(0), po.stride(0), po.stride(1), *plse.stride())
    kw = dict(GROUP=group, GP=1 << max(0, (group - 1).bit_length()), NQ=nq, BS=bs, D=d,
              BLOCK_N=cfg["block_n"], PAGE_BOX=cfg["page_box"], STAGES=cfg["stages"], TAIL_STAGES=TAIL_STAGES,
              PDL=pdl, TAILS=tails, SOFTCAP=cfg["softcap"] > 0, num_warps=4)
    bound = launch(_cascade_node_sm90_kernel, grid, *args, **kw)
    return bound and DescriptorRelaunch(bound, 4, again=(0,))
