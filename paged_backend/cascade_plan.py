"""Host-side planning of cascade (shared-prefix) decode: the prefix forest and its work partition.

Sharing is found from the block tables themselves: requests whose leading *full* blocks hold the
same block ids read the same K/V there (a partially filled last block is never shared). The forest
(:mod:`paged_backend.cascade_forest`) is a compressed trie over the rows' full blocks, built level
by level with vectorised numpy: rows grouped by a block id, each compared id by id against its
group's leader to the group's depth, then sub-grouped by the block at that depth. A cost model
(:class:`CascadeCost`) folds a node that does not pay off into its children as nodes are produced
(parents first): its tokens simply stay in each child's (or leaf's) range. Each request then owns

- the token ranges ``[start, end)`` of its kept ancestor nodes (disjoint, block aligned), and
- its private tail ``[shared_len, seq_len)``, run by the decode kernel.

The partition (stream-K over the GPU for both the node GEMMs and the leaf decode pieces) and the
merge lists are packed into one int32 array and copied to the device once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.checks import debug_enabled
from kernels.dispatch import num_sms
from paged_backend.cascade_forest import auto_forest, group_forest
from paged_backend.plan import block_n_for, cut_pieces, plan_decode

NODE_FIELDS = 7  # (rep request, kv_head, member base, members in block, token_start, token_end, slot base)
LEAF_FIELDS = 5  # (request, kv_head, token_start, token_end, slot) - the decode kernel's pieces
# Private tails are short (a few pages per request): half-size tiles and 4 programs per SM hide their
# dependent loads better than the flat decode's 2 x 64 (H200 sweep, 2026-11-21: tails 10-18% faster).
LEAF_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class CascadeCost:
    """When a node pays off. A node of ``n`` requests whose own range is ``L`` tokens saves
    ``(n - 1) * L * kv_bytes_per_token`` of reads (K and V of every KV head, ``kv_elem_bytes``
    each) and costs ``n * state_passes * Hq * (D + 1) * 4`` bytes of fp32 partial states (written
    by the node pieces, read by the merge) plus ``node_fixed_bytes`` (tile quantisation, the
    extra pieces). It is kept iff ``n >= 2`` and saving > cost; otherwise its tokens fold into its
    children. If the kept nodes save less than ``min_total_bytes`` in all, the plan falls back to
    flat decode (two fewer launches), so cascade is never slower than flat decode.
    ``CascadeCost(0, 0, 0)`` keeps every shared block (tests).

    ``wide_tile_flops``: node GEMM FLOPs per node program from which 256-row tiles may be chosen.
    On long GEMMs they run ~1.27x faster per FLOP than 128-row tiles, but every piece writes twice
    the partial-state rows (H100, end to end: 8192/64/256 at 6.5e7 FLOPs a program 11% slower,
    4096/256/128 at 1.3e8 even, 32768/256/256 at 1.0e9 15% faster)."""
    state_passes: float = 4.0
    node_fixed_bytes: float = 512 * 1024
    min_total_bytes: float = 8 * 1024 * 1024
    kv_elem_bytes: int = 2
    wide_tile_flops: float = 2.0 ** 28


def choose_block_m(rows: np.ndarray, tokens: np.ndarray, gp: int, head_dim: int, wide: bool = False) -> int:
    """Rows per node tile: the fewest wasted tile rows, weighing the K/V re-read per row block
    (bytes ~ 133 flop each on an H100) against the tensor-core work of padded rows. ``wide``: 256-row
    tiles (16 warps, see kernels/cascade.py) are a candidate too."""
    sizes = (16, 32, 64, 128, 256) if wide else (16, 32, 64, 128)
    cands = [bm for bm in sizes if bm >= gp and not (head_dim > 128 and bm > 64)]
    if not cands:
        return max(16, gp)
    if rows.size == 0:
        return cands[0]
    bms = np.array(cands)[:, None]
    costs = ((-(-rows // bms)) * tokens * (4 * head_dim * 133 + bms * 4 * head_dim)).sum(axis=1)  # [C]
    best, best_cost = cands[0], float(costs[0])
    for bm, cost in zip(cands[1:], costs[1:].tolist()):
        if cost < best_cost * 0.999:
            best, best_cost = bm, float(cost)
    return best


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
    max_merge_len: int = 1   # longest list of partial slots merged into one (request, kv_head)
    flat_plan: object = field(default=None, repr=False)  # a DecodePlan when no node pays off
    buffers: torch.Tensor = field(default=None, repr=False)
    views: dict = field(default_factory=dict, repr=False)
    partial_o: torch.Tensor = field(default=None, repr=False)
    partial_lse: torch.Tensor = field(default=None, repr=False)
    side_stream: object = field(default=None, repr=False)  # CUDA stream the node kernel runs on

    @property
    def num_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def is_flat(self) -> bool:
        return self.num_nodes == 0

    def nodes(self):
        """[(members (batch indices), token_start, token_end)] of the kept nodes, parents first."""
        return [(self.node_members[self.node_ptr[k]:self.node_ptr[k + 1]], int(self.node_start[k]),
                 int(self.node_end[k])) for k in range(self.num_nodes)]

    def unique_tokens(self) -> int:
        """Tokens whose K/V the plan reads (once per KV head)."""
        sizes = np.diff(self.node_ptr)
        return int((self.seq_lens_host - self.shared_len_host).sum()
                   + (self.node_end - self.node_start).sum()) if sizes.size else int(self.seq_lens_host.sum())


def build_plan(table, lens, *, num_q_heads, num_kv_heads, head_dim, block_size, device, groups, cost,
               node_programs, leaf_programs, block_table_device=None, forest=None) -> CascadePlan:
    hq, hkv, d, bs = num_q_heads, num_kv_heads, head_dim, block_size
    bsz = lens.size
    group = hq // hkv
    full = lens // bs
    cols_used = int(-(-lens.max() // bs)) if bsz else 0
    state_bytes = hq * (d + 1) * 4
    kv_tok = hkv * d * 2 * cost.kv_elem_bytes

    def pays(n, own_blocks):
        n = np.asarray(n, dtype=np.float64)
        saved = (n - 1) * own_blocks * bs * kv_tok
        return (n >= 2) & (own_blocks > 0) & (saved > n * cost.state_passes * state_bytes + cost.node_fixed_bytes)

    if forest is not None:  # an earlier step's nodes, already folded by the cost model
        ptr, members, level = forest.node_ptr, forest.node_members, forest.node_level
        nstart, nend, kd = forest.node_start // bs, forest.node_end // bs, forest.shared_len_host // bs
    elif groups is None:
        ptr, members, nstart, nend, level, kd = auto_forest(table, full, pays)
    else:
        ptr, members, nstart, nend, level, kd = group_forest(table, full, groups, pays)
    sizes = np.diff(ptr)
    saved_total = float(((sizes - 1) * (nend - nstart)).sum()) * bs * kv_tok
    if forest is None and sizes.size and saved_total < cost.min_total_bytes:
        ptr, members, nstart, nend, level = ptr[:1], members[:0], nstart[:0], nend[:0], level[:0]
        kd = np.zeros(bsz, dtype=np.int64)
    # a view (copied once into the device buffer); at least one column so the views stay 2-D
    bt_host = table[:, :cols_used] if cols_used else np.zeros((bsz, 1), dtype=np.int32)
    max_id = -1
    if bsz and cols_used and (debug_enabled() or bsz * cols_used <= (1 << 16)):
        used = np.arange(cols_used)[None, :] < (-(-lens // bs))[:, None]
        ids = bt_host[used]
        max_id = int(ids.max()) if ids.size else -1
        if ids.size and int(ids.min()) < 0:
            raise ValueError(f"block_table_cpu holds negative block ids in its used entries (min {int(ids.min())})")
    plan = CascadePlan(batch_size=bsz, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device=device,
                       seq_lens_host=lens, shared_len_host=kd * bs, node_ptr=ptr, node_members=members,
                       node_start=nstart * bs, node_end=nend * bs, node_level=level, block_table_host=bt_host,
                       max_block_id=max_id, block_n=block_n_for(d) // 2, node_block_n=64 if d <= 128 else 32)
    if plan.is_flat:
        plan.flat_plan = plan_decode(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                     device=device, num_programs=leaf_programs)
        src, h = _staging(plan, [("seq_lens", lens.size)], block_table_device)
        h["seq_lens"][:] = lens
        _upload(plan, src, h, block_table_device)
        return plan
    _partition(plan, group, node_programs, leaf_programs, block_table_device, cost.wide_tile_flops)
    return plan


def _staging(plan: CascadePlan, parts, block_table_device):
    """One int32 host array (pinned for a CUDA device) cut into the named parts ``[(name, size)]``,
    the block table last unless it is already on the device. -> (tensor, {name: host view})."""
    if block_table_device is None:
        parts = parts + [("block_table", plan.block_table_host.size)]
    src = torch.empty(sum(n for _, n in parts), dtype=torch.int32, pin_memory=plan.device.type == "cuda")
    host, at, views = src.numpy(), 0, {}
    for name, n in parts:
        views[name] = host[at: at + n]
        at += n
    if block_table_device is None:
        views["block_table"].reshape(plan.block_table_host.shape)[...] = plan.block_table_host
    return src, views


def _upload(plan: CascadePlan, src: torch.Tensor, host_views: dict, block_table_device) -> None:
    """Copies the filled staging array to the device at once and makes device views of its parts."""
    if plan.device.type == "cpu":
        plan.buffers = src  # already where the kernels read it
    else:
        plan.buffers = torch.empty(src.numel(), dtype=torch.int32, device=plan.device)
        plan.buffers.copy_(src, non_blocking=True)
    parts = plan.buffers.split([h.size for h in host_views.values()])
    plan.views.update(zip(host_views, parts))
    if block_table_device is not None:
        plan.views["block_table"] = block_table_device
    else:
        plan.views["block_table"] = plan.views["block_table"].view(plan.batch_size, plan.block_table_host.shape[1])


def _divmod(x: np.ndarray, n: int):
    if n & (n - 1) == 0:  # a power of two (the usual head count): shifts, not divisions
        return x >> (n.bit_length() - 1), x & (n - 1)
    return np.divmod(x, n)


def _write_leaves(work: np.ndarray, lseg, l0, l1, live, plan: CascadePlan, slot0: int) -> None:
    """Tail pieces -> ``work [P, 5]`` rows (request, kv_head, token_start, token_end, slot); the
    pieces of segment ``(live[i], kv_head)`` cover its tiles ``[l0, l1)``."""
    hkv, bn, shared, lens = plan.num_kv_heads, plan.block_n, plan.shared_len_host, plan.seq_lens_host
    if lseg.size == live.size * hkv:  # one piece per segment: its whole tail
        w = work.reshape(live.size, hkv, LEAF_FIELDS)
        w[:, :, 0] = live[:, None]
        w[:, :, 1] = np.arange(hkv)
        w[:, :, 2] = shared[live][:, None]
        w[:, :, 3] = lens[live][:, None]
    else:
        lq, lkvh = _divmod(lseg, hkv)
        lreq = live[lq]
        lstart = shared[lreq]
        for col, val in enumerate((lreq, lkvh, lstart + l0 * bn, np.minimum(lstart + l1 * bn, lens[lreq]))):
            work[:, col] = val
    work[:, 4] = np.arange(slot0, slot0 + lseg.size, dtype=np.int32)


def _partition(plan: CascadePlan, group: int, node_programs, leaf_programs, block_table_device,
               wide_tile_flops: float) -> None:
    hkv, d, bn, nbn, bsz = plan.num_kv_heads, plan.head_dim, plan.block_n, plan.node_block_n, plan.batch_size
    ptr, members, lens, shared = plan.node_ptr, plan.node_members, plan.seq_lens_host, plan.shared_len_host
    sms = num_sms(plan.device)
    gp = 1 << max(0, (group - 1).bit_length())
    sizes = ptr[1:] - ptr[:-1]
    ntok = plan.node_end - plan.node_start
    flops = float((sizes * ntok).sum()) * group * 4 * d * hkv  # the node GEMMs, unpadded
    bm = choose_block_m(sizes * gp, ntok, gp, d, wide=flops >= wide_tile_flops * (node_programs or sms))
    mpb = bm // gp
    plan.block_m = bm
    gn = node_programs or sms * (1 if bm >= 128 else 2)
    gl = leaf_programs or sms * LEAF_PROGRAMS_PER_SM
    plan.node_programs, plan.leaf_programs = int(gn), int(gl)
    # --- node segments: (node, kv_head, row block), laid end to end; pieces cut stream-K
    nrb = -(-sizes // mpb)
    per_node = hkv * nrb
    seg0 = per_node.cumsum() - per_node  # [K] each node's first segment
    seg_node = np.arange(sizes.size).repeat(per_node)
    seg_kvh, seg_rb = np.divmod(np.arange(seg_node.size) - seg0[seg_node], nrb[seg_node])
    seg, u0, u1, seg_ptr, nprog = cut_pieces((-(-ntok // nbn))[seg_node], gn)
    k, rb = seg_node[seg], seg_rb[seg]
    n_in = np.minimum(mpb, sizes[k] - rb * mpb)  # [Pn] members of the piece's row block
    slot_base = n_in.cumsum() - n_in
    n_node_slots = int(slot_base[-1] + n_in[-1])
    # --- leaves: (request, kv_head) private tails, decode pieces
    live = (lens > shared).nonzero()[0]
    if live.size:
        lseg, l0, l1, lseg_ptr, lprog = cut_pieces((-(-(lens[live] - shared[live]) // bn)).repeat(hkv), gl)
    else:  # every request lies wholly in nodes
        lseg = l0 = l1 = np.zeros(0, np.int64)
        lseg_ptr, lprog = np.zeros(1, np.int64), np.zeros(gl + 1, np.int64)
    n_leaf = lseg.size
    src, h = _staging(plan, [("node_work", seg.size * NODE_FIELDS), ("node_prog_ptr", nprog.size),
                             ("leaf_work", n_leaf * LEAF_FIELDS), ("leaf_prog_ptr", lprog.size),
                             ("req_ptr", bsz * hkv + 1), ("slots", n_node_slots + n_leaf),
                             ("members", members.size), ("seq_lens", bsz)], block_table_device)
    mbase = ptr[k] + rb * mpb
    kvh = seg_kvh[seg]
    t0 = plan.node_start[k]
    work = h["node_work"].reshape(-1, NODE_FIELDS)
    for col, val in enumerate((members[ptr[k]], kvh, mbase, n_in, t0 + u0 * nbn,
                               np.minimum(t0 + u1 * nbn, plan.node_end[k]), slot_base)):
        work[:, col] = val
    h["node_prog_ptr"][:] = nprog
    _write_leaves(h["leaf_work"].reshape(-1, LEAF_FIELDS), lseg, l0, l1, live, plan, n_node_slots)
    h["leaf_prog_ptr"][:] = lprog
    h["members"][:] = members
    h["seq_lens"][:] = lens
    # --- merge lists, CSR over (request, kv_head): its node slots (parents first, each node's
    # pieces in token order), then its tail's. A node's level is its place in each member's list
    # and a segment is usually one piece, so a list's node slots before level l are l, plus the
    # extra pieces of the cut segments above (at most one segment per level and list).
    level = plan.node_level
    seg_pieces = seg_ptr[1:] - seg_ptr[:-1]
    extra = np.zeros((int(level.max()) + 1, bsz, hkv), dtype=np.int64)  # [L, B, Hkv]
    cut = (seg_pieces > 1).nonzero()[0]
    if cut.size:
        kc = seg_node[cut]
        lo = ptr[kc] + seg_rb[cut] * mpb
        n = np.minimum(ptr[kc + 1], lo + mpb) - lo  # members of the segment's row block
        em = (lo - n.cumsum() + n).repeat(n) + np.arange(int(n.sum()))  # their memberships
        extra[level[kc].repeat(n), members[em], seg_kvh[cut].repeat(n)] = (seg_pieces[cut] - 1).repeat(n)
    count = extra.sum(axis=0)  # [B, Hkv]
    count += np.bincount(members, minlength=bsz)[:, None]
    if n_leaf == live.size * hkv:  # one piece per tail
        count += (lens > shared)[:, None]
    else:
        count[live] += (lseg_ptr[1:] - lseg_ptr[:-1]).reshape(live.size, hkv)
    req_ptr = h["req_ptr"]
    req_ptr[0] = 0
    np.cumsum(count, out=req_ptr[1:])
    # each level's first node slot in each list, then per (membership, kv_head)
    at = np.empty_like(extra)
    at[0] = req_ptr[:-1].reshape(bsz, hkv)
    for lv in range(1, at.shape[0]):
        at[lv] = at[lv - 1] + extra[lv - 1] + 1
    at = at[level.repeat(sizes), members].reshape(-1)  # [M * Hkv]
    # node slots: member j of piece p's row block -> its list's slot for p's level + p's rank
    j = np.arange(mpb)
    pos = (mbase * hkv + kvh)[:, None] + j * hkv  # [Pn, mpb]
    rank = (np.arange(seg.size) - seg_ptr[seg])[:, None]
    if int(n_in.min()) < mpb:  # partial row blocks
        full = j < n_in[:, None]
        pos, rank = pos[full], np.broadcast_to(rank, full.shape)[full]
    pos = at[pos]
    pos += rank
    slots = h["slots"]
    slots[pos.reshape(-1)] = np.arange(n_node_slots, dtype=np.int32)
    # leaf slots: the last of each list, in piece order
    if n_leaf:
        last = req_ptr[1:].reshape(bsz, hkv)[live].reshape(-1) - lseg_ptr[1:]  # [live * Hkv]
        slots[last[lseg] + np.arange(n_leaf)] = np.arange(n_node_slots, n_node_slots + n_leaf, dtype=np.int32)
    plan.num_node_pieces, plan.num_leaf_pieces = int(seg.size), int(n_leaf)
    plan.num_slots = n_node_slots + int(n_leaf)
    plan.max_merge_len = int(count.max()) if count.size else 1
    _upload(plan, src, h, block_table_device)
    plan.views["node_work"] = plan.views["node_work"].view(-1, NODE_FIELDS)
    plan.views["leaf_work"] = plan.views["leaf_work"].view(-1, LEAF_FIELDS)
    plan.partial_o = torch.empty(max(1, plan.num_slots), group, d, dtype=torch.float32, device=plan.device)
    plan.partial_lse = torch.empty(max(1, plan.num_slots), group, dtype=torch.float32, device=plan.device)
