"""Host-side planning of cascade (shared-prefix) decode: the prefix forest and its work partition.

Sharing is found from the block tables themselves: requests whose leading *full* blocks hold the
same block ids read the same K/V there (a partially filled last block is never shared). The forest
(:mod:`paged_backend.cascade.forest`) is a compressed trie over the rows' full blocks, built level
by level with vectorised numpy: rows grouped by a block id, each compared id by id against its
group's leader to the group's depth, then sub-grouped by the block at that depth. A cost model
(:class:`CascadeCost`) folds a node that does not pay off into its children as nodes are produced
(parents first): its tokens simply stay in each child's (or leaf's) range. Each request then owns

- the token ranges ``[start, end)`` of its kept ancestor nodes (disjoint, block aligned), and
- its private tail ``[shared_len, seq_len)``, run by the decode kernel.

The partition (:mod:`paged_backend.cascade.partition`: stream-K over the GPU for both the node
GEMMs and the leaf decode pieces) and the merge lists are packed into one int32 array and copied to
the device once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from paged_backend.kernels.checks import debug_enabled
from paged_backend.kernels.decode import fold_block_p
from paged_backend.cascade.forest import auto_forest, group_forest
from paged_backend.cascade.partition import LEAF_FIELDS, NODE_FIELDS, partition, staging, upload
from paged_backend.cascade.reuse import check_held, restrict_forest
from paged_backend.decode_plan import block_n_for, plan_decode

__all__ = ["CascadeCost", "CascadePlan", "build_plan", "NODE_FIELDS", "LEAF_FIELDS"]


@dataclass(frozen=True)
class CascadeCost:
    """When a node pays off. A node of ``n`` requests whose own range is ``L`` tokens saves
    ``(n - 1) * L * kv_bytes_per_token`` of reads (K and V of every KV head, ``kv_elem_bytes``
    each) and costs ``n * state_passes * Hq * (D + 1) * 4`` bytes of fp32 partial states (written
    by the node pieces, read by the merge) plus ``node_fixed_bytes`` (tile quantisation, the
    extra pieces). It is kept iff ``n >= 2`` and saving > cost; otherwise its tokens fold into its
    children. If the kept nodes save less than ``min_total_bytes`` in all, the plan falls back to
    flat decode (two fewer launches), so cascade is never slower than flat decode, planned for caches of
    ``kv_elem_bytes`` (fp8 ones: the programs of the Hopper decode kernel). Over caches of other than 2 bytes a
    value (fp8) the plans take the Hopper kernel's 128-row tiles only where every node fills one
    (cascade/fused.py), and its fused lists only up to ``fp8_fused_flops`` node GEMM FLOPs a node program.
    ``CascadeCost(0, 0, 0)`` keeps every shared block (tests).

    ``wide_tile_flops``: node GEMM FLOPs per node program from which 256-row tiles may be chosen.
    On long GEMMs they run ~1.27x faster per FLOP than 128-row tiles, but every piece writes twice
    the partial-state rows (H100, end to end: 8192/64/256 at 6.5e7 FLOPs a program 11% slower,
    4096/256/128 at 1.3e8 even, 32768/256/256 at 1.0e9 15% faster).

    ``fp8_fused_flops``: over fp8 caches, the node GEMM FLOPs per node program up to which the Hopper node kernel
    runs the tails too (fused lists). Its node side is slower so (the tails' consumer takes registers and shared
    memory from the converter), which the tails beside it repay up to a few 1e8 FLOPs a program (H200,
    2026-12-01, one call, three rounds, fused against nodes-only + tails on the decode kernel: 8192/64/256 at 6.5e7
    45.2-46.4 vs 53.6-53.7 us, 4096/256/128 at 1.3e8 81.6-81.9 vs 82.4-84.1, 32768/64/32 at 2.6e8 98.5-99.0 vs
    98.2-102.0, 32768/256/256 at 1.0e9 359.7-361.1 vs 349.9-351.6; results/sweeps/cascade_fp8_sm90_h200.log
    section 10): 2^29 lies between the last two. ``bench_cascade.py --kv-dtype fp8 --fp8-fused-flops inf,0`` times
    both sides in one process."""
    state_passes: float = 4.0
    node_fixed_bytes: float = 512 * 1024
    min_total_bytes: float = 8 * 1024 * 1024
    kv_elem_bytes: int = 2
    wide_tile_flops: float = 2.0 ** 28
    fp8_fused_flops: float = 2.0 ** 29


@dataclass
class CascadePlan:
    """A cascade decode step, planned on the host (see module doc). Host copies describe the
    forest; the device views live in one int32 buffer filled by one copy."""
    batch_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    device: torch.device
    seq_lens_host: np.ndarray = field(repr=False)
    shared_len_host: np.ndarray = field(repr=False)     # [B] tokens covered by kept nodes
    node_ptr: np.ndarray = field(repr=False)            # [K + 1] CSR into node_members
    node_members: np.ndarray = field(repr=False)        # batch indices
    node_start: np.ndarray = field(repr=False)          # [K] token range of each kept node
    node_end: np.ndarray = field(repr=False)
    node_level: np.ndarray = field(repr=False)          # [K] kept ancestors: the place in each member's list
    block_table_host: np.ndarray = field(repr=False)    # [B, cols] int32 (cols = blocks in use)
    max_block_id: int = -1
    block_m: int = 16
    block_n: int = 64        # leaf (decode) tile
    node_block_n: int = 64   # node tile
    node_programs: int = 1
    leaf_programs: int = 1
    num_node_pieces: int = 0
    num_leaf_pieces: int = 0
    num_slots: int = 0
    # longest list of partial slots merged into one (request, kv_head); in an arena, its first plan's
    max_merge_len: int = 1
    window: int | None = None  # sliding window: nodes trimmed to their members' windows, tails from the window
    # with a window: the forest before trimming, (ptr, members, start, end, level) in blocks, for reuse
    forest_nodes: tuple = field(default=None, repr=False)
    flat_plan: object = field(default=None, repr=False)  # a DecodePlan when no node pays off
    buffers: torch.Tensor = field(default=None, repr=False)
    views: dict = field(default_factory=dict, repr=False)
    partial_o: torch.Tensor = field(default=None, repr=False)
    partial_lse: torch.Tensor = field(default=None, repr=False)
    side_stream: object = field(default=None, repr=False)  # CUDA stream the node kernel runs on
    host: dict = field(default_factory=dict, repr=False)  # the staging array's parts on the host, by name
    # call signature -> the node, tail and fold kernels' launches for it (kernels/cascade.py: cascade_triton)
    launches: dict = field(default_factory=dict, repr=False)
    arena: object = field(default=None, repr=False)  # the CascadeArena holding the device buffers, or None

    def launch_key(self) -> tuple:
        """What the kernels' launches take from the plan besides its buffers' contents: grids, tiles,
        which launches run, the merge's tile (:func:`fold_states`) - not the piece counts, which the
        kernels read from the lists (so a forest that loses a request keeps its key). Plans of one
        arena with equal keys launch identically, so a CUDA graph of one replays the other; in a
        fixed arena the key is a function of the batch size (``CascadeArena.for_graphs``)."""
        return (self.batch_size, self.window, self.is_flat, self.block_m, self.node_block_n, self.block_n,
                self.node_programs, self.leaf_programs, self.launch_all or self.num_node_pieces > 0,
                self.launch_all or self.num_leaf_pieces > 0, "fused_prog_ptr" in self.views,
                fold_block_p(self.max_merge_len))

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def launch_all(self) -> bool:
        """Whether the node and tail launches run even on empty lists (a fixed arena's plan)."""
        return self.arena is not None and self.arena.fixed

    @property
    def is_flat(self) -> bool:
        """Whether the plan runs as a flat decode (no node, ``flat_plan``); a fixed arena's plan without
        nodes runs its tails on the cascade kernels instead."""
        return self.flat_plan is not None

    def nodes(self):
        """[(members (batch indices), token_start, token_end)] of the kept nodes, parents first."""
        return [(self.node_members[self.node_ptr[k]:self.node_ptr[k + 1]], int(self.node_start[k]),
                 int(self.node_end[k])) for k in range(self.num_nodes)]

    def node_reps(self) -> np.ndarray:
        """[K] the member each node's keys are read through (its block-table row): the one whose window
        starts first, else the first member. A row's entries wholly below its window may name no block
        of its own (vLLM's Model Runner V2 puts its null block there); the node starts at that member's
        window block, so every key is read from a block it holds."""
        first = self.node_members[self.node_ptr[:-1]]
        if not self.window or not self.num_nodes:
            return first
        sizes = np.diff(self.node_ptr)
        order = np.lexsort((self.window_start()[self.node_members], np.arange(sizes.size).repeat(sizes)))
        return self.node_members[order[self.node_ptr[:-1]]]

    def window_start(self) -> np.ndarray:
        """[B] int64 each request's first key attended: ``max(0, len - window)``, 0 without a window."""
        lens = self.seq_lens_host.astype(np.int64)
        return np.maximum(lens - self.window, 0) if self.window else np.zeros_like(lens)

    def tail_start(self) -> np.ndarray:
        """[B] int64 where each request's private tail (run as decode) starts: after its kept nodes,
        and not before its window."""
        return np.maximum(self.shared_len_host.astype(np.int64), self.window_start())

    def unique_tokens(self) -> int:
        """Tokens whose K/V the plan reads (once per KV head)."""
        if self.is_flat:
            return int((self.seq_lens_host - self.window_start()).sum())
        return int((self.seq_lens_host - self.tail_start()).sum() + (self.node_end - self.node_start).sum())


def build_plan(table, lens, *, num_q_heads, num_kv_heads, head_dim, block_size, device, groups, cost,
               node_programs, leaf_programs, block_table_device=None, forest=None, forest_rows=None,
               window=None, arena=None, host_lens=None) -> CascadePlan:
    hq, hkv, d, bs = num_q_heads, num_kv_heads, head_dim, block_size
    bsz = lens.size
    group = hq // hkv
    known = lens if host_lens is None else host_lens  # [B] tokens whose block ids the host table holds
    full = known // bs
    cols_used = int(-(-lens.max() // bs)) if bsz else 0
    state_bytes = hq * (d + 1) * 4
    kv_tok = hkv * d * 2 * cost.kv_elem_bytes

    def pays(n, own_blocks):
        n = np.asarray(n, dtype=np.float64)
        saved = (n - 1) * own_blocks * bs * kv_tok
        return (n >= 2) & (own_blocks > 0) & (saved > n * cost.state_passes * state_bytes + cost.node_fixed_bytes)

    if forest is not None:  # an earlier step's nodes, already folded by the cost model
        if forest.forest_nodes is not None:  # planned with a window: its nodes before trimming
            ptr, members, nstart, nend, level = forest.forest_nodes
        else:
            ptr, members, level = forest.node_ptr, forest.node_members, forest.node_level
            nstart, nend = forest.node_start // bs, forest.node_end // bs
        kd = forest.shared_len_host // bs
        if forest_rows is not None:  # a batch of some of its requests
            ptr, members, nstart, nend, level, kd = restrict_forest(ptr, members, nstart, nend, level, forest_rows,
                                                                    forest.batch_size, pays)
        check_held(table, known, bs, ptr, members, nstart, nend, kd, debug_enabled())
    elif groups is None:
        ptr, members, nstart, nend, level, kd = auto_forest(table, full, pays)
    else:
        ptr, members, nstart, nend, level, kd = group_forest(table, full, groups, pays)
    sizes = np.diff(ptr)
    saved_total = float(((sizes - 1) * (nend - nstart)).sum()) * bs * kv_tok
    if (forest is None or forest_rows is not None) and sizes.size and saved_total < cost.min_total_bytes:
        ptr, members, nstart, nend, level = ptr[:1], members[:0], nstart[:0], nend[:0], level[:0]
        kd = np.zeros(bsz, dtype=np.int64)
    forest_nodes = None
    if window is not None:
        forest_nodes = (ptr, members, nstart, nend, level)
        ptr, members, nstart, nend, level = trim_to_window(ptr, members, nstart, nend, level,
                                                           np.maximum(lens - window, 0) // bs)
    # a view (copied once into the device buffer); at least one column so the views stay 2-D
    bt_host = table[:, :cols_used] if cols_used else np.zeros((bsz, 1), dtype=np.int32)
    max_id = -1
    if bsz and cols_used and known.any() and (debug_enabled() or bsz * cols_used <= (1 << 16)):
        max_id, low = _used_id_bounds(bt_host, -(-known // bs))
        if low < 0:
            raise ValueError(f"block_table_cpu holds negative block ids in its used entries (min {low})")
    plan = CascadePlan(batch_size=bsz, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device=device,
                       seq_lens_host=lens, shared_len_host=kd * bs, node_ptr=ptr, node_members=members,
                       node_start=nstart * bs, node_end=nend * bs, node_level=level, block_table_host=bt_host,
                       max_block_id=max_id, block_n=block_n_for(d) // 2, node_block_n=64 if d <= 128 else 32,
                       window=window, forest_nodes=forest_nodes, arena=arena)
    if plan.num_nodes == 0 and not plan.launch_all:
        # (over an fp8 cache, the fp8 decode plan: either fp8 format plans alike)
        plan.flat_plan = plan_decode(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                     device=device, num_programs=leaf_programs, window=window,
                                     kv_dtype=torch.float8_e4m3fn if cost.kv_elem_bytes == 1 else None)
        src, h = staging(plan, [("seq_lens", lens.size)], block_table_device)
        h["seq_lens"][:] = lens
        upload(plan, src, h, block_table_device)
        return plan
    # (a window moves the nodes' trimmed starts and the tails' starts: the partition is made anew)
    partition(plan, group, node_programs, leaf_programs, block_table_device, cost,
              forest if forest_rows is None and window is None else None)
    if arena is not None and arena.fixed and plan.arena is None:  # too big for it: the step as tails only
        if plan.num_nodes == 0:
            raise ValueError(f"a step of {bsz} rows does not fit the fixed arena (CascadeArena.for_graphs: made for "
                             "fewer rows, or other node_programs/leaf_programs)")
        return build_plan(table, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device=device,
                          groups=[], cost=cost, node_programs=node_programs, leaf_programs=leaf_programs,
                          block_table_device=block_table_device, window=window, arena=arena, host_lens=host_lens)
    return plan


def _used_id_bounds(table: np.ndarray, blocks: np.ndarray) -> tuple[int, int]:
    """(max, min(0, min)) of the block ids each row uses, ``table [B, C]``'s first ``blocks [B]``
    entries: the columns every row uses plainly, a masked reduction over the ragged rest only (the
    rows of a decode step are mostly one length; a masked reduction is ~3x slower a value)."""
    full = int(blocks.min())
    hi, lo = -1, 0
    if full:
        head = table[:, :full]
        hi, lo = int(head.max()), min(0, int(head.min()))
    if full < table.shape[1]:
        rest = table[:, full:]
        used = np.arange(full, table.shape[1])[None, :] < blocks[:, None]
        hi = max(hi, int(np.max(rest, where=used, initial=-1)))
        lo = min(lo, int(np.min(rest, where=used, initial=0)))
    return hi, lo


def trim_to_window(ptr, members, start, end, level, lo):
    """The nodes (CSR ``ptr``/``members``, ``start``/``end`` in blocks, ``level``, parents first) as
    members whose keys start at block ``lo [B]`` (sliding windows) read them: a node starts at its
    members' first window block, and one no member's window reaches is dropped (the levels below
    it move up). Members whose window starts past a kept node stay in it: their rows mask its keys.
    -> the same five arrays."""
    sizes = ptr[1:] - ptr[:-1]
    if not sizes.size:
        return ptr, members, start, end, level
    km = np.arange(sizes.size).repeat(sizes)  # [M] each membership's node
    first = np.full(sizes.size, np.iinfo(np.int64).max)
    np.minimum.at(first, km, lo[members])  # [K] the earliest window start among its members
    dropped = first >= end
    if not dropped.any():
        return ptr, members, np.maximum(start, first), end, level
    # Levels: a kept node moves up by the dropped nodes above it in its members' chain (the same
    # chain for all its members; read it from its first member's).
    above = np.zeros((int(members.max()) + 1, int(level.max()) + 2), dtype=np.int64)
    above[members, level[km] + 1] = dropped[km]
    np.cumsum(above, axis=1, out=above)
    keep = ~dropped
    new_level = level - above[members[ptr[:-1]], level]
    kept_members = np.repeat(keep, sizes)
    new_ptr = np.zeros(int(keep.sum()) + 1, dtype=ptr.dtype)
    np.cumsum(sizes[keep], out=new_ptr[1:])
    return (new_ptr, members[kept_members], np.maximum(start, first)[keep], end[keep], new_level[keep])
