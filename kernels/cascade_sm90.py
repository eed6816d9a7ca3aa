"""The cascade node kernel for Hopper (sm_90): the node pieces of a ``CascadePlan`` with TMA page loads
and warp-specialised wgmma (kernels/attend_sm90.py), writing the same partial states as
``_cascade_node_kernel`` (kernels/cascade.py), which the fold then uses unchanged.

A piece = (node, KV head, row block of 128 rows, token range): its rows are ``128 // GP`` member
requests x ``GP`` query heads (the plan's ``block_m`` of 128), two consumer warpgroups of 64 rows
each; the loader warp streams the range's K/V tiles (64 keys, three stages: ``node_sm90_config``).
Programs are persistent over the plan's piece lists (``node_prog_ptr``), and loader and consumers
count ring tiles across pieces. Piece ranges start on a page or on a multiple of the plan's
``node_block_n`` (64) inside a node whose keys are whole shared pages, so page boxes of
``min(BS, 64)`` rows never straddle a page, and boxes past a range's end load zeros.

``TAILS``: the programs run the plan's ``fused_items`` (paged_backend/cascade/fused.py
``fused_order``), node pieces and the private tails' pieces together, and the decode kernel does not
run. A tail piece is a row block of one request (its ``GP`` heads), run by one consumer warpgroup
(by the piece's parity: two consecutive tail pieces run side by side) while the other only releases
its tiles; the last tile's V rows past the tail's end (inside its page: any values) are zeroed.
One kernel streaming both leaves out the second kernel's ramp-up and drain, and lets SMs on tail
pieces (bound by memory) run beside SMs on node pieces (bound by their GEMM pipeline).

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
from paged_backend.kernels.attend_sm90 import (ROWS, alloc_rings, attend_tiles, covered, descriptors, finish_state,
                                               io_layout, load_range, load_rows, mma_layout, release_tiles)
from paged_backend.kernels.launch import DescriptorRelaunch, launch

NODE_BLOCK_M = 128  # the plan tile the kernel takes: CONSUMERS x ROWS rows
# (keys a K/V tile, ring stages): see node_sm90_config; PAGED_BACKEND_NODE_TILE=KEYSxSTAGES sets them (a sweep)
NODE_TILE = tuple(int(x) for x in os.environ.get("PAGED_BACKEND_NODE_TILE", "64x3").split("x"))


@gluon.jit
def _piece(work_ptr, leaf_ptr, items_ptr, p, TAILS: gl.constexpr):
    """Piece ``p`` of the program lists -> (rep request, kv_head, member base, members, token_start,
    token_end, slot base); a tail piece (``TAILS``: an item ``-1 - j``) has member base -1 and one
    member, its request."""
    i = p
    if TAILS:
        i = gl.load(items_ptr + p)
    if i >= 0:
        w = work_ptr + i * 7  # (rep request, kv_head, member base, members, token_start, token_end, slot base)
        rep = gl.load(w)
        kvh = gl.load(w + 1)
        mbase = gl.load(w + 2)
        n_in = gl.load(w + 3)
        start = gl.load(w + 4)
        end = gl.load(w + 5)
        slot = gl.load(w + 6)
    else:
        w = leaf_ptr + (-1 - i) * 5  # (request, kv_head, token_start, token_end, slot)
        rep = gl.load(w)
        kvh = gl.load(w + 1)
        mbase = rep * 0 - 1
        n_in = rep * 0 + 1
        start = gl.load(w + 2)
        end = gl.load(w + 3)
        slot = gl.load(w + 4)
    return rep, kvh, mbase, n_in, start, end, slot


@gluon.jit
def _node_load_partition(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pieces,
                         bt_ptr, stride_btb, stride_btn, page_rows, head_rows, head_cols, oob_row,
                         BS: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_BOX: gl.constexpr, STAGES: gl.constexpr,
                         TAILS: gl.constexpr):
    """One warp: the K/V tiles of every piece of this program, in order."""
    work_ptr, leaf_ptr, items_ptr, prog_ptr = pieces
    g = gl.program_id(0)
    it = gl.to_tensor(0)  # ring tiles so far (a tensor: it is carried through the loop)
    for p in range(gl.load(prog_ptr + g), gl.load(prog_ptr + g + 1)):
        rep, kvh, _, _, start, end, _ = _piece(work_ptr, leaf_ptr, items_ptr, p, TAILS)
        bt_row_ptr = bt_ptr + rep.to(gl.int64) * stride_btb
        it = load_range(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it,
                        gl.maximum(gl.cdiv(end - start, BLOCK_N), 1), bt_row_ptr, stride_btn, start, end, kvh,
                        kvh * head_cols, page_rows, head_rows, oob_row, BS, BLOCK_N, PAGE_BOX, STAGES)


@gluon.jit
def _node_consumer_partition(rows, pieces, WG: gl.constexpr, GROUP: gl.constexpr, GP: gl.constexpr, D: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TAILS: gl.constexpr, SOFTCAP: gl.constexpr):
    """One warpgroup: rows ``WG * ROWS ..`` of each piece (members x ``GP`` heads) -> partial slots;
    a piece without such rows only has its tiles released.

    The partial states are stored from the accumulator's own layout, not converted to rows of 16
    bytes first: the conversion (through shared memory, with warpgroup barriers) sat between each
    piece's GEMMs and the next piece's, and the tail pieces are many. The stores ask the L2 to keep
    the states (``evict_last``), which the fold reads back after the tails have streamed through it.
    H100, 2026-11-26: 8192/64/256 63.3 -> 60.3 us, 4096/256/128 95.3 -> 91.1 us (of which the
    eviction hint 1 and 0 us), 131072/8/1024 213.4 -> 215.1 us
    (``benchmarks/results/sweeps/cascade_consumer_sm90_h100.log``)."""
    (q_ptr, members_ptr, po_ptr, plse_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
     v_empty, stride_qb, stride_qh, stride_pop, stride_poh, stride_plp, stride_plh, sm_scale, cap) = rows
    work_ptr, leaf_ptr, items_ptr, prog_ptr = pieces
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(D)
    loc_io = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout()))
    loc_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    loc_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    q_tile = q_smem.index(WG)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
    head = loc_io % GP  # query head of each row (GP divides ROWS)
    g = gl.program_id(0)
    it = gl.to_tensor(0)
    for p in range(gl.load(prog_ptr + g), gl.load(prog_ptr + g + 1)):
        rep, kvh, mbase, n_in, start, end, slot_base = _piece(work_ptr, leaf_ptr, items_ptr, p, TAILS)
        n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 1)
        # a node piece: rows WG * ROWS .. of its row block; a tail piece (GP rows of one request): the
        # consumer of its parity, so that the two run consecutive tail pieces side by side
        tail = mbase < 0
        m0 = (1 - tail.to(gl.int32)) * (WG * ROWS // GP)  # the consumer's first member in the piece
        if (tail & (p % 2 == WG)) | ((not tail) & (m0 < n_in)):
            mem = m0 + loc_io // GP  # member (within the piece's row block) of each row
            mem_s = m0 + loc_s // GP
            ok = (mem < n_in) & (head < GROUP)
            req = gl.load(members_ptr + mbase + mem, mask=(mem < n_in) & (mbase >= 0), other=0).to(gl.int64)
            req = gl.where(tail, rep.to(gl.int64), req)  # a tail piece's one member: its request
            load_rows(q_tile, q_ptr, req, kvh * GROUP + head, ok, stride_qb, stride_qh, D)
            acc, m_i, l_i = attend_tiles(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, it, n_tiles,
                                         (end - start) // BLOCK_N, start, end, loc_s, qk_scale, cap, D, BLOCK_N,
                                         STAGES, False, TAILS, SOFTCAP, False)
            o, lse = finish_state(acc, m_i, l_i)  # [ROWS, D] in the accumulator's layout, [ROWS] in the scores'
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
def _cascade_node_sm90_kernel(
    q_ptr, k_desc, v_desc, bt_ptr, members_ptr, work_ptr, leaf_ptr, items_ptr, prog_ptr, po_ptr, plse_ptr,
    sm_scale, cap, page_rows, head_rows, head_cols, oob_row,
    stride_qb, stride_qh, stride_btb, stride_btn, stride_pop, stride_poh, stride_plp, stride_plh,
    GROUP: gl.constexpr, GP: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
    PAGE_BOX: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, TAILS: gl.constexpr, SOFTCAP: gl.constexpr,
):
    if PDL:  # the tails or the merge may launch now: they wait for this grid where they must
        gdc_launch_dependents()
    q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = alloc_rings(k_desc, v_desc, D, BLOCK_N, STAGES)
    rows = (q_ptr, members_ptr, po_ptr, plse_ptr, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
            v_empty, stride_qb, stride_qh, stride_pop, stride_poh, stride_plp, stride_plh, sm_scale, cap)
    pieces = (work_ptr, leaf_ptr, items_ptr, prog_ptr)
    gl.warp_specialize([
        (_node_consumer_partition, (rows, pieces, 0, GROUP, GP, D, BLOCK_N, STAGES, TAILS, SOFTCAP)),
        (_node_consumer_partition, (rows, pieces, 1, GROUP, GP, D, BLOCK_N, STAGES, TAILS, SOFTCAP)),
        (_node_load_partition, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, pieces,
                                bt_ptr, stride_btb, stride_btn, page_rows, head_rows, head_cols, oob_row,
                                BS, BLOCK_N, PAGE_BOX, STAGES, TAILS)),
    ], [4, 1], [240, 24])


def node_sm90_config(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan, softcap: float,
                     scales) -> dict | None:
    """The Hopper node kernel's settings for a plan's node pieces, or None (the portable node kernel
    runs; the caller checked the device): what ``attend_sm90.covered`` covers, a plan tile of 128
    rows and node ranges cut at multiples of 64 keys, no window or fp8 scales (soft-capped or not).

    Tiles of 64 keys in three stages, where the prefill kernel takes 128 x 2: node pieces are short
    (a few dozen tiles) and tail pieces shorter, and finer stages keep more of them in flight (H100,
    2026-11-26: 8192/64/256 72.1 -> 66.0 us, 4096/256/128 120.2 -> 115.8 us; four stages of 64 and
    the prefill with 64-key tiles were slower; ``results/sweeps/cascade_fused_sm90_h100.log``)."""
    if scales[0] is not None or plan.window or plan.block_m != NODE_BLOCK_M or plan.node_block_n % 64:
        return None
    view = covered(q, k_cache, v_cache)
    if view is None:
        return None
    block_n, stages = NODE_TILE
    return dict(block_n=block_n, page_box=min(k_cache.shape[1], 64), stages=stages, view=view, softcap=softcap)


def cascade_nodes_sm90(q, k_cache, v_cache, plan, scale: float, cfg: dict, pdl: bool, tails: bool):
    """The plan's node pieces into its partial slots (``plan.partial_o`` / ``partial_lse``), and with
    ``tails`` (the plan has ``fused_items``) its tail pieces too. -> a relaunch of it taking the
    addresses of (q, k_cache, v_cache), or None (as ``launch(...).lead(3)``)."""
    hq, d = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    v, view = plan.views, cfg["view"]
    bt, po, plse = v["block_table"], plan.partial_o, plan.partial_lse
    grid = (plan.node_programs,)
    items, prog = (v["fused_items"], v["fused_prog_ptr"]) if tails else (v["node_prog_ptr"], v["node_prog_ptr"])
    args = (q, *descriptors(k_cache, v_cache, view, cfg["page_box"], cfg["block_n"]), bt, v["members"],
            v["node_work"], v["leaf_work"], items, prog, po, plse, scale, cfg["softcap"] * LOG2E,
            *view[2:], view[0],
            q.stride(0), q.stride(1), *bt.stride(), po.stride(0), po.stride(1), *plse.stride())
    kw = dict(GROUP=group, GP=1 << max(0, (group - 1).bit_length()), BS=bs, D=d, BLOCK_N=cfg["block_n"],
              PAGE_BOX=cfg["page_box"], STAGES=cfg["stages"], PDL=pdl, TAILS=tails, SOFTCAP=cfg["softcap"] > 0,
              num_warps=4)
    bound = launch(_cascade_node_sm90_kernel, grid, *args, **kw)
    return bound and DescriptorRelaunch(bound, 3)
