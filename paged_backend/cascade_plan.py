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

from kernels.checks import HEAD_DIMS, check_heads, debug_enabled
from kernels.dispatch import num_sms
from paged_backend.cascade_forest import auto_forest, group_forest
from paged_backend.plan import block_n_for, cut_pieces, plan_decode

NODE_FIELDS = 7  # (rep request, kv_head, member base, members in block, token_start, token_end, slot base)
LEAF_FIELDS = 5  # (request, kv_head, token_start, token_end, slot) - the decode kernel's pieces


@dataclass(frozen=True)
class CascadeCost:
    """When a node pays off. A node of ``n`` requests whose own range is ``L`` tokens saves
    ``(n - 1) * L * kv_bytes_per_token`` of reads (K and V of every KV head, ``kv_elem_bytes``
    each) and costs ``n * state_passes * Hq * (D + 1) * 4`` bytes of fp32 partial states (written
    by the node pieces, read by the merge) plus ``node_fixed_bytes`` (tile quantisation, the
    extra pieces). It is kept iff ``n >= 2`` and saving > cost; otherwise its tokens fold into its
    children. If the kept nodes save less than ``min_total_bytes`` in all, the plan falls back to
    flat decode (two fewer launches), so cascade is never slower than flat decode.
    ``CascadeCost(0, 0, 0)`` keeps every shared block (tests)."""
    state_passes: float = 4.0
    node_fixed_bytes: float = 512 * 1024
    min_total_bytes: float = 8 * 1024 * 1024
    kv_elem_bytes: int = 2


def _positive_int(name, val):
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return int(val)


def _host_array(name, x, ndim):
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a host (CPU) tensor or numpy array; got a tensor on {x.device} "
                             "(keep a host copy of the metadata; the plan copies it to the device once)")
        x = x.numpy()
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr


def choose_block_m(rows: np.ndarray, tokens: np.ndarray, gp: int, head_dim: int) -> int:
    """Rows per node tile: the fewest wasted tile rows, weighing the K/V re-read per row block
    (bytes ~ 133 flop each on an H100) against the tensor-core work of padded rows."""
    cands = [bm for bm in (16, 32, 64, 128) if bm >= gp and not (head_dim > 128 and bm > 64)]
    if not cands:
        return max(16, gp)
    if rows.size == 0:
        return cands[0]
    best, best_cost = cands[0], None
    for bm in cands:
        blocks = -(-rows // bm)
        cost = float((blocks * tokens * (4 * head_dim * 133 + bm * 4 * head_dim)).sum())
        if best_cost is None or cost < best_cost * 0.999:
            best, best_cost = bm, cost
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
               node_programs, leaf_programs, block_table_device=None) -> CascadePlan:
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

    if groups is None:
        ptr, members, nstart, nend, kd = auto_forest(table, full, pays)
    else:
        ptr, members, nstart, nend, kd = group_forest(table, full, groups, pays)
    sizes = np.diff(ptr)
    saved_total = float(((sizes - 1) * (nend - nstart)).sum()) * bs * kv_tok
    if sizes.size and saved_total < cost.min_total_bytes:
        ptr, members, nstart, nend = ptr[:1], members[:0], nstart[:0], nend[:0]
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
                       node_start=nstart * bs, node_end=nend * bs, block_table_host=bt_host, max_block_id=max_id,
                       block_n=block_n_for(d), node_block_n=64 if d <= 128 else 32)
    if plan.is_flat:
        plan.flat_plan = plan_decode(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                     device=device, num_programs=leaf_programs)
        _upload(plan, [("seq_lens", lens)], block_table_device)
        return plan
    _partition(plan, group, node_programs, leaf_programs, block_table_device)
    return plan


def _upload(plan: CascadePlan, parts, block_table_device) -> None:
    """Packs the int32 arrays into one (pinned) host array and copies it to the device once."""
    if block_table_device is None:
        parts = parts + [("block_table", plan.block_table_host)]
    total = sum(int(np.asarray(p).size) for _, p in parts)
    src = torch.empty(total, dtype=torch.int32, pin_memory=plan.device.type == "cuda")
    host = src.numpy()
    at, spans = 0, {}
    for name, p in parts:
        p = np.asarray(p)
        n = int(p.size)
        host[at: at + n].reshape(p.shape)[...] = p
        spans[name] = (at, n)
        at += n
    if plan.device.type == "cpu":
        plan.buffers = src  # already where the kernels read it
    else:
        plan.buffers = torch.empty(total, dtype=torch.int32, device=plan.device)
        plan.buffers.copy_(src, non_blocking=True)
    for name, (at, n) in spans.items():
        plan.views[name] = plan.buffers[at: at + n]
    if block_table_device is not None:
        plan.views["block_table"] = block_table_device
    else:
        plan.views["block_table"] = plan.views["block_table"].view(plan.batch_size, plan.block_table_host.shape[1])


def _rank_in_runs(ids: np.ndarray) -> np.ndarray:
    """Position of each element within its run of equal consecutive ``ids``."""
    idx = np.arange(ids.size)
    first = np.ones(ids.size, dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return idx - np.maximum.accumulate(np.where(first, idx, 0))


def _merge_lists(plan: CascadePlan, mpb, nrb, per_node, seg, n_in, slot_base, mbase, piece_kvh, lseg, lkey, lslot):
    """CSR over (request, kv_head) of the partial-state slots to merge: for each, the slots of its
    node pieces (nodes in order, then pieces in token order), then its leaf pieces'. Built by
    counting: a node slot's place = the list's start + the pieces of its earlier nodes (an exclusive
    cumsum over the request's memberships) + its piece's rank within the segment."""
    hkv, bsz = plan.num_kv_heads, plan.batch_size
    ptr, members = plan.node_ptr, plan.node_members
    n_seg = int(per_node.sum())
    seg_pieces = np.bincount(seg, minlength=n_seg)
    # memberships (node-major): node, row block; pieces per (membership, kv_head)
    m_node = np.repeat(np.arange(nrb.size), np.diff(ptr))
    m_rb = (np.arange(members.size) - ptr[m_node]) // mpb
    m_seg0 = (np.cumsum(per_node) - per_node)[m_node] + m_rb
    cnt = seg_pieces[m_seg0[:, None] + np.arange(hkv)[None, :] * nrb[m_node][:, None]]  # [M, Hkv]
    om = np.argsort(members, kind="stable")  # by request, nodes in order
    cs = np.cumsum(cnt[om], axis=0)
    excl = cs - cnt[om]
    req_sorted = members[om]
    first = np.ones(om.size, dtype=bool)
    first[1:] = req_sorted[1:] != req_sorted[:-1]
    last = np.append(np.flatnonzero(first)[1:], om.size) - 1
    base = np.maximum.accumulate(np.where(first, np.arange(om.size), 0))
    off = np.empty_like(excl)
    off[om] = excl - excl[base]
    count = np.zeros((bsz, hkv), dtype=np.int64)
    count[req_sorted[last]] = cs[last] - excl[base[last]]  # node slots per (request, kv_head)
    node_count = count.ravel().copy()
    count = count.ravel()
    count += np.bincount(lkey, minlength=bsz * hkv)
    req_ptr = np.zeros(bsz * hkv + 1, dtype=np.int64)
    np.cumsum(count, out=req_ptr[1:])
    # node slots: (piece, member of its row block)
    e_piece = np.repeat(np.arange(seg.size), n_in)
    e_m = mbase[e_piece] + np.arange(e_piece.size) - np.repeat(slot_base, n_in)
    e_kvh = piece_kvh[e_piece]
    e_key = members[e_m] * hkv + e_kvh
    slots = np.empty(int(req_ptr[-1]), dtype=np.int64)
    slots[req_ptr[e_key] + off[e_m, e_kvh] + _rank_in_runs(seg)[e_piece]] = np.arange(e_piece.size)
    slots[req_ptr[lkey] + node_count[lkey] + _rank_in_runs(lseg)] = lslot
    return req_ptr, slots


def _partition(plan: CascadePlan, group: int, node_programs, leaf_programs, block_table_device) -> None:
    hkv, d, bn, nbn = plan.num_kv_heads, plan.head_dim, plan.block_n, plan.node_block_n
    sms = num_sms(plan.device)
    gp = 1 << max(0, (group - 1).bit_length())
    sizes = np.diff(plan.node_ptr)
    ntok = plan.node_end - plan.node_start
    bm = choose_block_m(sizes * gp, ntok, gp, d)
    mpb = bm // gp
    plan.block_m = bm
    gn = node_programs or sms * (1 if bm >= 128 else 2)
    gl = leaf_programs or sms * 2
    plan.node_programs, plan.leaf_programs = int(gn), int(gl)
    # --- node segments: (node, kv_head, row block), laid end to end
    nrb = -(-sizes // mpb)
    per_node = hkv * nrb
    seg_node = np.repeat(np.arange(sizes.size), per_node)
    within = np.arange(int(per_node.sum())) - np.repeat(np.cumsum(per_node) - per_node, per_node)
    seg_kvh = within // nrb[seg_node]
    seg_rb = within % nrb[seg_node]
    seg_units = -(-ntok[seg_node] // nbn)
    seg, u0, u1, _, nprog = cut_pieces(seg_units, gn)
    k = seg_node[seg]
    n_in = np.minimum(mpb, sizes[k] - seg_rb[seg] * mpb)
    slot_base = np.cumsum(n_in) - n_in
    mbase = plan.node_ptr[k] + seg_rb[seg] * mpb
    node_work = np.stack([plan.node_members[plan.node_ptr[k]], seg_kvh[seg], mbase, n_in,
                          plan.node_start[k] + u0 * nbn, np.minimum(plan.node_start[k] + u1 * nbn, plan.node_end[k]),
                          slot_base], axis=1)
    n_node_slots = int(n_in.sum())
    # --- leaves: (request, kv_head) private tails, decode pieces
    tail = plan.seq_lens_host - plan.shared_len_host
    live = np.flatnonzero(tail > 0)
    lseg_req = np.repeat(live, hkv)
    lseg_kvh = np.tile(np.arange(hkv), live.size)
    lseg_units = -(-tail[lseg_req] // bn)
    lseg, l0, l1, _, lprog = cut_pieces(lseg_units, gl) if live.size else (np.zeros(0, np.int64),) * 3 + (
        np.zeros(gl + 1, np.int64),)
    lreq = lseg_req[lseg]
    lstart = plan.shared_len_host[lreq]
    lslot = n_node_slots + np.arange(lseg.size)
    leaf_work = np.stack([lreq, lseg_kvh[lseg], lstart + l0 * bn,
                          np.minimum(lstart + l1 * bn, plan.seq_lens_host[lreq]), lslot], axis=1)
    # --- merge lists, CSR over (request, kv_head): node slots (parents first, then token order),
    # then the tail's. Counted and scattered (no sort over the slots).
    req_ptr, slots = _merge_lists(plan, mpb, nrb, per_node, seg, n_in, slot_base, mbase, seg_kvh[seg],
                                  lseg, lseg_req[lseg] * hkv + lseg_kvh[lseg], lslot)
    plan.num_node_pieces, plan.num_leaf_pieces = int(seg.size), int(lseg.size)
    plan.num_slots = n_node_slots + int(lseg.size)
    plan.max_merge_len = int(np.diff(req_ptr).max()) if req_ptr.size > 1 else 1
    parts = [("node_work", node_work), ("node_prog_ptr", nprog), ("leaf_work", leaf_work),
             ("leaf_prog_ptr", lprog), ("req_ptr", req_ptr), ("slots", slots),
             ("members", plan.node_members), ("seq_lens", plan.seq_lens_host)]
    _upload(plan, parts, block_table_device)
    plan.views["node_work"] = plan.views["node_work"].view(-1, NODE_FIELDS)
    plan.views["leaf_work"] = plan.views["leaf_work"].view(-1, LEAF_FIELDS)
    plan.partial_o = torch.empty(max(1, plan.num_slots), group, d, dtype=torch.float32, device=plan.device)
    plan.partial_lse = torch.empty(max(1, plan.num_slots), group, dtype=torch.float32, device=plan.device)


def plan_cascade(block_table_cpu, seq_lens_cpu, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, device=None, groups=None, cost: CascadeCost | None = None,
                 node_programs: int | None = None, leaf_programs: int | None = None,
                 block_table_device: torch.Tensor | None = None) -> CascadePlan:
    """Plan one cascade decode step from host metadata (see module doc).

    ``block_table_cpu [B, max_blocks]`` and ``seq_lens_cpu [B]``: host (CPU tensor / numpy) copies.
    ``groups``: optional explicit groups from the scheduler (lists of batch indices, nested or
    disjoint); their common leading full blocks are verified and only those are shared. ``cost``:
    the :class:`CascadeCost` deciding which nodes pay off. ``node_programs`` / ``leaf_programs``
    override the persistent grids (default SMs x occupancy). ``block_table_device``: the same table
    already on ``device`` (int32, any strides): the kernels read it instead of a fresh copy.
    """
    table = _host_array("block_table_cpu", block_table_cpu, 2)
    lens = _host_array("seq_lens_cpu", seq_lens_cpu, 1).astype(np.int64)
    for name, val in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim), ("block_size", block_size)):
        _positive_int(name, val)
    check_heads(num_q_heads, num_kv_heads)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if table.shape[0] != lens.size:
        raise ValueError(f"block_table_cpu has {table.shape[0]} rows but seq_lens_cpu has {lens.size} entries")
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens_cpu must be >= 0, got min {lens.min()}")
    if lens.size and lens.max() > table.shape[1] * block_size:
        raise ValueError(f"seq_lens_cpu max {lens.max()} exceeds the block table's capacity "
                         f"{table.shape[1]} blocks x {block_size}")
    if cost is None:
        cost = CascadeCost()
    elif not isinstance(cost, CascadeCost):
        raise TypeError(f"cost must be a CascadeCost or None, got {type(cost).__name__}")
    for name, val in (("node_programs", node_programs), ("leaf_programs", leaf_programs)):
        if val is not None:
            _positive_int(name, val)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch.device or device string, got {device!r}") from e
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if block_table_device is not None:
        if not isinstance(block_table_device, torch.Tensor):
            raise TypeError(f"block_table_device must be a torch.Tensor, got {type(block_table_device).__name__}")
        if block_table_device.dtype != torch.int32 or block_table_device.device != device \
                or block_table_device.dim() != 2 or block_table_device.shape[0] != lens.size \
                or block_table_device.shape[1] < min(table.shape[1], -(-int(lens.max() if lens.size else 0) // block_size)):
            raise ValueError("block_table_device must be an int32 [B, >= blocks in use] tensor on "
                             f"{device} holding block_table_cpu's ids")
    return build_plan(table, lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, device=device, groups=groups, cost=cost,
                      node_programs=node_programs, leaf_programs=leaf_programs,
                      block_table_device=block_table_device)
