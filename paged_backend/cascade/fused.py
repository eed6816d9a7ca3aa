"""How the plans the Hopper kernel runs (kernels/cascade_sm90.py) are cut, host numpy: whether a plan gets
128-row node tiles (:func:`hopper_nodes`), with the lists it runs in one launch (each program's node pieces, and
beside them a run of the tail pieces, ``fused_prog_ptr``; over fp8 caches where the node GEMMs are short:
``CascadeCost.fp8_fused_flops``), and their node pieces in lockstep.

Lockstep: stream-K (``plan.cut_pieces``) lays the (node, KV head, row block) segments end to end and
cuts them into equal runs of the grid, so the pieces of one KV head's row blocks start at offsets
drifting across the node's keys, and each row block re-reads the keys long after the others: on
32768/256/256 (8 row blocks of 128 rows a KV head, 16 MB of keys each) ~1 GB moved for a 134 MB prefix.
Where every node segment is equally long (one shared prefix, or nodes of one length), :func:`lockstep`
cuts each into ``k`` equal pieces, piece ``i`` the only node piece of program ``i``: the row blocks of a
(node, KV head) walk the same keys at the same time, and all but the first read them from L2. The
programs past ``k`` x segments get no node piece (the tails are still cut over all of them). On the H100
(2026-11-26, ``benchmarks/results/sweeps/cascade_lockstep_h100.log``): 32768/256/256 449-453 us with the
portable kernel's 256-row tiles -> 336-343 us with the fused 128-row Hopper kernel, 8192/64/256 66.5 ->
63.8 us, 4096/256/128 99 -> 95.5 us (fewer, equal pieces). So the planner gives such plans 128-row tiles
whatever rows their nodes have: with the tails in the same launch, plans of 8-64 rows a node (2-16
samples: 32768/16/512, 131072/8/1024 and three more) also ran 2-5% faster than on the portable kernels'
16-64-row tiles, though a consumer warpgroup's 64 rows are then partly empty.
"""
from __future__ import annotations

import numpy as np

from paged_backend.decode_plan import FP8_SM90_PROGRAMS_PER_SM, programs_per_sm
from paged_backend.kernels.dispatch import sm90_shape, use_sm90

FUSED_BLOCK_M = 128  # the node tile of the Hopper kernel's fused lists
LOCKSTEP_FILL = 7 / 8  # lockstep node pieces may leave this much of the node grid without node work
# Over fp8 caches, the rows each node needs before its plan takes the Hopper kernel's 128-row lockstep tiles: with
# fewer, its consumer warpgroups run partly empty and the conversion of every tile is paid for few rows (H200,
# 2026-11-30, engine plans: 32768/256/256 653 -> 441 us, 8192/64/256 65.1 -> 60.9; but 32768/16/512, 64 rows a
# node, 61.7 -> 84.2; benchmarks/results/sweeps/cascade_fp8_sm90_h200.log)
FP8_MIN_ROWS = 128


def hopper_nodes(plan) -> bool:
    """Whether the Hopper node kernel may run the plan's node pieces in 128-row tiles (what
    ``kernels/ring_sm90.covered`` takes that a plan knows: head size 64 or 128, pages of 16+ tokens, a
    power-of-two group up to 64; node ranges cut at multiples of 64 keys, no window). Over 16-bit caches
    such plans get fused lists as well (the tails in the same launch: 3-11% faster than the node kernel
    then the decode kernel on every shape tried, H100, 2026-11-26, 64-key tiles;
    ``benchmarks/results/sweeps/cascade_fused_sm90_h100.log``, run 10); over fp8 caches the node kernel
    takes converter warps, the plan takes 128-row tiles only where every node fills one
    (:data:`FP8_MIN_ROWS`), and fused lists only where its node GEMMs are short (``CascadeCost.fp8_fused_flops``:
    the tails' consumer beside the converter slows the node side)."""
    return (sm90_shape(plan.head_dim, plan.block_size, plan.num_q_heads // plan.num_kv_heads)
            and not plan.node_block_n % 64 and not plan.window and use_sm90(plan.device))


def hopper_tails(plan, kv_elem_bytes: int) -> bool:
    """Whether the Hopper decode kernel runs the plan's tails over an fp8 cache (kernels/cascade.py
    ``tails_sm90_view``; over 16-bit caches the node kernel runs them, where the plan has fused lists): where it
    would run a decode plan of these shapes (``decode_plan.programs_per_sm``: 3 programs an SM, the tails' grid
    then, paged_backend/cascade/partition.py ``leaf_grid``; at the portable tails' 4 the kernel spills), and the
    tail pieces are cut where no page box of ``min(BS, 64)`` keys straddles a page."""
    return (programs_per_sm(plan.device, kv_elem_bytes, plan.num_q_heads, plan.num_kv_heads, plan.head_dim,
                            plan.block_size, plan.window) == FP8_SM90_PROGRAMS_PER_SM
            and not plan.block_n % min(plan.block_size, 64))


def lockstep(units: np.ndarray, per_node: np.ndarray, grid: int) -> int:
    """Pieces per node segment when they may run in lockstep, else 0: every node of ``units [K]`` key
    tiles (``per_node [K]`` segments: KV heads x row blocks) equally long, and ``k`` pieces of each
    filling at least ``LOCKSTEP_FILL`` of the ``grid``.

    See the module doc; ``k`` is at most the tiles, so no piece is empty."""
    n_seg = int(per_node.sum())
    if not units.size or (units != units[0]).any() or n_seg > grid:
        return 0
    k = min(grid // n_seg, int(units[0]))
    return k if k * n_seg >= LOCKSTEP_FILL * grid else 0


def lockstep_pieces(units: int, n_seg: int, k: int, grid: int):
    """``n_seg`` segments of ``units`` each cut into ``k`` pieces, piece ``i`` the only one of program
    ``i`` (programs ``k * n_seg ..`` get none). -> as :func:`paged_backend.decode_plan.cut_pieces`."""
    part = np.tile(np.arange(k), n_seg)  # [P] each piece's place in its segment
    cut_at = (part > 0).nonzero()[0]
    return (np.arange(n_seg).repeat(k), np.arange(n_seg + 1) * k, np.minimum(np.arange(grid + 1), n_seg * k),
            cut_at, part[cut_at] * units // k)

