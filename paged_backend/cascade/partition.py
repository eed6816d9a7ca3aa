"""The work partition of a cascade plan (host numpy), once per step: the node pieces, the tail
pieces and the merge lists, packed into one int32 array that is copied to the device at once.

- Node work is ``(node, kv_head, row block)`` segments laid end to end; tails are ``(request,
  kv_head)`` segments. Both are cut stream-K over persistent programs (:func:`cut_pieces`); a
  piece is its segment's work row, its token range cut where a program run ends.
- Each piece writes one fp32 partial state per request of its row block (a *slot*), node slots
  first, in piece order. The merge list of ``(request, kv_head)`` holds its node slots (parents
  first, a node's pieces in token order), then its tail's: CSR ``req_ptr`` over the lists, ``slots``
  (:mod:`paged_backend.cascade.merge_lists`).
- On Hopper, plans of 128-row node tiles over 16-bit caches also get the tails cut over the node programs
  (``fused_prog_ptr``: program ``g``'s run of tail pieces), which the Hopper kernel runs beside each program's
  node pieces in one launch (kernels/cascade_sm90.py); the slots are the same, so other kernels ignore the runs.
  Their node segments (and those of fp8 plans whose nodes fill 128-row tiles) are cut in lockstep where they are
  equally long, not stream-K (:mod:`paged_backend.cascade.fused`).
"""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.cascade.fused import (FP8_MIN_ROWS, FUSED_BLOCK_M, hopper_nodes, hopper_tails, lockstep,
                                        lockstep_pieces)
from paged_backend.cascade.merge_lists import merge_lists
from paged_backend.kernels.dispatch import num_sms
from paged_backend.kernels.launch import pow2
from paged_backend.decode_plan import FP8_SM90_PROGRAMS_PER_SM, cut_pieces

NODE_FIELDS = 7  # (rep request, kv_head, member base, members in block, token_start, token_end, slot base)
LEAF_FIELDS = 5  # (request, kv_head, token_start, token_end, slot) - the decode kernel's pieces
# Private tails are short (a few pages per request): half-size tiles and 4 programs per SM hide their
# dependent loads better than the flat decode's 2 x 64 (H200 sweep, 2026-11-21: tails 10-18% faster).
LEAF_PROGRAMS_PER_SM = 4


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
    bms = np.array(cands)
    # the tiles' tokens per candidate, times each tile token's cost (integers: exact)
    costs = (((-rows) // bms[:, None]) @ -tokens) * (4 * head_dim * (133 + bms))  # [C]
    best, best_cost = cands[0], float(costs[0])
    for bm, cost in zip(cands[1:], costs[1:].tolist()):
        if cost < best_cost * 0.999:
            best, best_cost = bm, float(cost)
    return best


def graph_block_m(batch: int, group: int, head_dim: int) -> int:
    """The node tile of every plan of ``batch`` rows in a fixed arena (``CascadeArena.for_graphs``): the
    one a node of all the rows would take (one prompt's samples, the forest such runners see most)."""
    gp = pow2(group)
    return choose_block_m(np.array([batch * gp]), np.ones(1, np.int64), gp, head_dim)


def graph_capacity(max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device, node_programs,
                   leaf_programs, memberships_per_row: int) -> tuple[dict[str, int], int]:
    """(capacity {part: int32 entries}, partial-state slots) for the plans of up to ``max_batch`` rows in
    a fixed arena: the worst over the batch sizes of a tails-only plan and of a forest of up to
    ``memberships_per_row`` node memberships a row. Stream-K cuts each program run's end into at most
    one segment, so pieces <= segments + programs; each node segment (node, KV head, row block) holds
    at most a row block's members, and has at most one more row block than its members fill."""
    sms, group, hkv = num_sms(device), num_q_heads // num_kv_heads, num_kv_heads
    gl = leaf_programs or sms * LEAF_PROGRAMS_PER_SM
    cap = dict.fromkeys(("node_work", "node_prog_ptr", "leaf_work", "leaf_prog_ptr", "req_ptr", "slots",
                         "members", "seq_lens"), 0)
    slots = 0
    for b in range(1, max_batch + 1):
        bm = graph_block_m(b, group, head_dim)
        mpb, gn = max(1, bm // pow2(group)), _node_grid(node_programs, sms, bm)
        members = memberships_per_row * b
        node_pieces = hkv * (members // mpb + b) + gn  # (a forest of b rows has < b nodes)
        node_slots = hkv * members + gn * mpb
        leaf_pieces = b * hkv + gl
        need = dict(node_work=node_pieces * NODE_FIELDS, node_prog_ptr=gn + 1, leaf_work=leaf_pieces * LEAF_FIELDS,
                    leaf_prog_ptr=gl + 1, req_ptr=b * hkv + 1, slots=node_slots + leaf_pieces, members=members,
                    seq_lens=b)
        cap = {name: max(n, need[name]) for name, n in cap.items()}
        slots = max(slots, node_slots + leaf_pieces)
    return cap, slots


def partition(plan, group: int, node_programs, leaf_programs, block_table_device, cost, forest=None) -> None:
    """Fills ``plan`` (a CascadePlan with its forest) with the partition and its device views.
    ``cost``: the plan's CascadeCost (its ``wide_tile_flops`` and ``kv_elem_bytes``). ``forest``: the
    earlier plan whose nodes ``plan`` reuses; its partition is copied where only the tails' lengths
    changed (the same tails, one piece each, the same programs)."""
    sms = num_sms(plan.device)
    gl = leaf_grid(plan, leaf_programs, sms, cost)
    # (a fixed arena's plan copies only another's: an eager plan's tile and lists would change its launches)
    if forest is not None and forest.launch_all == plan.launch_all \
            and _node_grid(node_programs, sms, forest.block_m) == forest.node_programs \
            and gl == forest.leaf_programs and _same_tails(plan, forest, gl):
        src, h = _copy_partition(plan, forest, block_table_device)
    else:
        src, h = _new_partition(plan, group, node_programs, gl, sms, block_table_device, cost)
    if plan.arena is not None:  # an arena's plans fold alike (the launch key): as its first plan's lists
        plan.max_merge_len = plan.arena.fold_len = plan.arena.fold_len or plan.max_merge_len
    upload(plan, src, h, block_table_device)
    if plan.launch_all:  # an empty part's view has no address (torch gives 0) that a launch on it may keep
        for name, width in (("node_work", NODE_FIELDS), ("leaf_work", LEAF_FIELDS), ("members", 1), ("slots", 1)):
            if not plan.views[name].numel():
                plan.views[name] = plan.arena.part(name, width)  # (a row of its room, never read)
    plan.views["node_work"] = plan.views["node_work"].view(-1, NODE_FIELDS)
    plan.views["leaf_work"] = plan.views["leaf_work"].view(-1, LEAF_FIELDS)
    if plan.arena is not None:  # (its partial states: at fixed addresses too)
        plan.partial_o, plan.partial_lse = plan.arena.partial_o, plan.arena.partial_lse
    else:
        plan.partial_o = torch.empty(max(1, plan.num_slots), group, plan.head_dim, dtype=torch.float32,
                                     device=plan.device)
        plan.partial_lse = torch.empty(max(1, plan.num_slots), group, dtype=torch.float32, device=plan.device)


def leaf_grid(plan, leaf_programs, sms: int, cost) -> int:
    """The tails' persistent grid: the override, else ``LEAF_PROGRAMS_PER_SM`` an SM, or
    ``FP8_SM90_PROGRAMS_PER_SM`` where the Hopper decode kernel runs them (fused.hopper_tails)."""
    if leaf_programs:
        return leaf_programs
    return sms * (FP8_SM90_PROGRAMS_PER_SM if hopper_tails(plan, cost.kv_elem_bytes) else LEAF_PROGRAMS_PER_SM)


def _node_grid(node_programs, sms: int, block_m: int) -> int:
    """The node kernel's persistent grid: the override, else one program per SM for tiles of
    >= 128 rows (8-16 warps) and two for smaller ones."""
    return node_programs or sms * (1 if block_m >= 128 else 2)


def _same_tails(plan, forest, gl: int) -> bool:
    """Whether ``forest``'s tail pieces serve this step with only their ends moved: the same requests
    have tails as then, and each tail has as many tiles as then (the stream-K cut is a function of
    the tiles, the programs and the KV heads: the same pieces, lists and slots; decode steps of one
    token move a tail to its next tile once every ``block_n`` tokens), or one piece per (request,
    kv_head) then and now. With fused lists the tails are cut over the node programs (``fused_prog_ptr``),
    and those runs must be the same."""
    lens, shared, hkv = plan.seq_lens_host, plan.tail_start(), plan.num_kv_heads
    was, was_shared = forest.seq_lens_host, forest.tail_start()
    live = lens > shared
    if not np.array_equal(live, was > was_shared):
        return False
    units = -(-(lens[live] - shared[live]) // plan.block_n)  # [n] each live tail's tiles
    if np.array_equal(units, -(-(was[live] - was_shared[live]) // plan.block_n)):
        return True
    n = units.size
    if forest.num_leaf_pieces != n * hkv:
        return False
    fused = "fused_prog_ptr" in forest.host
    lseg, _, lprog, cut_at, _ = cut_pieces(units, forest.node_programs if fused else gl, hkv)
    if cut_at.size or lseg.size != n * hkv:
        return False
    return np.array_equal(lprog, forest.host["fused_prog_ptr" if fused else "leaf_prog_ptr"])


def _copy_partition(plan, forest, block_table_device):
    """``forest``'s partition with this step's lengths: the last piece of each tail ends at its
    request's length (the pieces of a (request, kv_head) tail are consecutive; their starts and
    inner cuts stay). -> the staging (tensor, {part: host view})."""
    src, h = staging(plan, [(name, v.size) for name, v in forest.host.items() if name != "block_table"],
                     block_table_device)
    for name, v in forest.host.items():
        if name not in ("seq_lens", "block_table"):
            h[name][:] = v
    work = h["leaf_work"].reshape(-1, LEAF_FIELDS)
    if work.size:
        last = np.ones(work.shape[0], dtype=bool)
        last[:-1] = (work[1:, 0] != work[:-1, 0]) | (work[1:, 1] != work[:-1, 1])
        work[last, 3] = plan.seq_lens_host[work[last, 0]]
    h["seq_lens"][:] = plan.seq_lens_host
    for name in ("block_m", "node_programs", "leaf_programs", "num_node_pieces", "num_leaf_pieces", "num_slots",
                 "max_merge_len"):
        setattr(plan, name, getattr(forest, name))
    return src, h


def _new_partition(plan, group: int, node_programs, gl: int, sms: int, block_table_device, cost):
    """The partition from scratch. -> the staging (tensor, {part: host view})."""
    hkv, d, bsz, nbn, bn = plan.num_kv_heads, plan.head_dim, plan.batch_size, plan.node_block_n, plan.block_n
    ptr, members, lens, shared = plan.node_ptr, plan.node_members, plan.seq_lens_host, plan.tail_start()
    start, end = plan.node_start, plan.node_end
    gp = 1 << max(0, (group - 1).bit_length())
    sizes = ptr[1:] - ptr[:-1]
    units = -(-(end - start) // nbn)  # [K] each node's key tiles
    live = (lens > shared).nonzero()[0]  # the requests with a private tail
    # Hopper runs 128-row tiles with the tails in one launch (fused lists: the tails cut over the node programs,
    # which take them whole: fewer, longer pieces; no piece may start inside a page box) - over fp8 caches where
    # the node GEMMs are short (cost.fp8_fused_flops)
    g128 = _node_grid(node_programs, sms, FUSED_BLOCK_M)
    fixed = plan.launch_all  # (a fixed arena's plan: its tile is the batch size's, no fused lists)
    hopper = not fixed and hopper_nodes(plan)
    # 128-row tiles in lockstep (k pieces a node segment) beat the tiles chosen for the portable kernel on every
    # plan measured with fused lists (cascade/fused.py): 256-row ones (32768/256/256) and those of 16-64 rows
    # (32768/16/512, 131072/8/1024); over fp8 caches, where every node has FP8_MIN_ROWS rows
    fp8_lockstep = hopper and cost.kv_elem_bytes == 1 and (sizes * gp >= FP8_MIN_ROWS).all()
    flops = float((sizes * (end - start)).sum()) * group * 4 * d * hkv  # the node GEMMs, unpadded
    fusable = bool(live.size) and (hopper and cost.kv_elem_bytes == 2
                                   or fp8_lockstep and flops <= cost.fp8_fused_flops * g128)
    if fusable:
        tail_cut = cut_pieces(-(-(lens[live] - shared[live]) // bn), g128, hkv)
        fusable = not (tail_cut[4] * bn % min(plan.block_size, 64)).any()
    k = lockstep(units, hkv * -(-sizes * gp // FUSED_BLOCK_M), g128) if fusable or fp8_lockstep else 0
    if k:
        bm = FUSED_BLOCK_M
    elif fixed:
        bm = graph_block_m(bsz, group, d)
    else:
        bm = choose_block_m(sizes * gp, end - start, gp, d, wide=flops >= cost.wide_tile_flops * (node_programs or sms))
    mpb = bm // gp
    gn = _node_grid(node_programs, sms, bm)
    fuse = fusable and bm == FUSED_BLOCK_M
    plan.block_m, plan.node_programs, plan.leaf_programs = bm, int(gn), int(gl)
    # --- node segments: (node, kv_head, row block), laid end to end
    nrb = -(-sizes // mpb)
    per_node = hkv * nrb
    node = np.arange(sizes.size).repeat(per_node)  # [S] each segment's node
    seg0 = np.cumsum(per_node) - per_node  # [K] each node's first segment
    kvh, rb = np.divmod(np.arange(node.size) - seg0[node], nrb[node])
    mbase = ptr[node] + rb * mpb  # [S] the row block's first membership
    n_in = np.minimum(ptr[node + 1] - mbase, mpb)  # [S] and its members
    if k:
        seg, seg_ptr, nprog, cut_at, cut_off = lockstep_pieces(int(units[0]), int(per_node.sum()), k, gn)
    elif not units.size:  # no node (a fixed arena's tails-only plan)
        seg = cut_at = cut_off = np.zeros(0, np.int64)
        seg_ptr, nprog = np.zeros(1, np.int64), np.zeros(gn + 1, np.int64)
    else:
        seg, seg_ptr, nprog, cut_at, cut_off = cut_pieces(units, gn, per_node)
    n_node_slots = int(n_in.sum() + n_in[seg[cut_at]].sum())
    # --- tails: (request, kv_head) segments; fused, the decode kernel's programs take runs of the pieces
    if fuse:
        lseg, lseg_ptr, lprog, lcut_at, lcut_off = tail_cut
    elif live.size:
        lseg, lseg_ptr, lprog, lcut_at, lcut_off = cut_pieces(-(-(lens[live] - shared[live]) // bn), gl, hkv)
    else:  # every request lies wholly in nodes
        lseg = lcut_at = lcut_off = np.zeros(0, np.int64)
        lseg_ptr, lprog = np.zeros(1, np.int64), np.zeros(gl + 1, np.int64)
    n_leaf = lseg.size
    fused = [("fused_prog_ptr", gn + 1)] if fuse else []
    src, h = staging(plan, [("node_work", seg.size * NODE_FIELDS), ("node_prog_ptr", nprog.size),
                            ("leaf_work", n_leaf * LEAF_FIELDS), ("leaf_prog_ptr", gl + 1),
                            ("req_ptr", bsz * hkv + 1), ("slots", n_node_slots + n_leaf),
                            ("members", members.size), ("seq_lens", bsz), *fused], block_table_device)
    # node pieces: their segment's row (a copy when segments are cut), then the cut token ranges
    work = h["node_work"].reshape(-1, NODE_FIELDS)
    rows = np.empty((node.size, NODE_FIELDS), np.int32) if cut_at.size else work
    for col, val in enumerate((plan.node_reps()[node], kvh, mbase, n_in, start[node], end[node])):
        rows[:, col] = val
    if cut_at.size:
        np.take(rows, seg, axis=0, out=work, mode="clip")
        tok = work[cut_at, 4] + cut_off * nbn
        work[cut_at, 4] = tok
        work[cut_at - 1, 5] = tok
    slot_base = np.cumsum(work[:, 3], dtype=np.int64)
    slot_base -= work[:, 3]
    work[:, 6] = slot_base
    h["node_prog_ptr"][:] = nprog
    # tail pieces likewise: (request, kv_head, shared, seq_len, slot)
    if n_leaf:
        lwork = h["leaf_work"].reshape(-1, LEAF_FIELDS)
        rows = np.empty((live.size * hkv, LEAF_FIELDS), np.int32) if lcut_at.size else lwork
        w = rows.reshape(live.size, hkv, LEAF_FIELDS)
        for col, val in enumerate((live[:, None], np.arange(hkv), shared[live][:, None], lens[live][:, None])):
            w[:, :, col] = val
        if lcut_at.size:
            np.take(rows, lseg, axis=0, out=lwork, mode="clip")
            tok = lwork[lcut_at, 2] + lcut_off * bn
            lwork[lcut_at, 2] = tok
            lwork[lcut_at - 1, 3] = tok
        lwork[:, 4] = np.arange(n_node_slots, n_node_slots + n_leaf)
    if fuse:  # the Hopper kernel's runs as cut; the decode kernel's: equal numbers of pieces (a copied
        h["fused_prog_ptr"][:] = lprog  # partition keeps them)
        h["leaf_prog_ptr"][:] = np.arange(gl + 1) * n_leaf // gl
    else:
        h["leaf_prog_ptr"][:] = lprog
    h["members"][:] = members
    h["seq_lens"][:] = lens
    count = merge_lists(plan, h, kvh, mbase, n_in, nrb, seg0, seg, seg_ptr, cut_at, slot_base, mpb,
                         live, lseg, lseg_ptr, n_node_slots)
    plan.num_node_pieces, plan.num_leaf_pieces = int(seg.size), int(n_leaf)
    plan.num_slots = n_node_slots + int(n_leaf)
    plan.max_merge_len = int(count.max())
    return src, h


def staging(plan, parts, block_table_device):
    """One int32 host array (pinned for a CUDA device) cut into the named parts ``[(name, size)]``:
    the layout of ``plan.arena`` where the parts fit it (else ``plan.arena`` becomes None), or the
    parts end to end, the block table last unless it is already on the device. -> (tensor, {name:
    host view})."""
    arena, sizes = plan.arena, dict(parts)
    # (the "slots" part holds one entry per partial state: the plan's num_slots, not yet set here)
    if arena is not None and not arena.fits(sizes, sizes.get("slots", 0), plan.num_q_heads // plan.num_kv_heads,
                                            plan.head_dim):
        arena = plan.arena = None
    if arena is not None:
        return arena.stage(sizes)
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


def upload(plan, src: torch.Tensor, host_views: dict, block_table_device) -> None:
    """Copies the filled staging array (:func:`staging`) to the device at once and makes device views
    of its parts: into ``plan.arena`` where it was staged for it, else fresh buffers."""
    plan.host = host_views
    arena = plan.arena
    if arena is not None:
        plan.buffers = arena.buffer
        plan.views.update(arena.send(src, {k: v.size for k, v in host_views.items()}))
    elif plan.device.type == "cpu":
        plan.buffers = src  # already where the kernels read it
    else:
        plan.buffers = torch.empty(src.numel(), dtype=torch.int32, device=plan.device)
        plan.buffers.copy_(src, non_blocking=True)
    if arena is None:
        parts = plan.buffers.split_with_sizes([v.size for v in host_views.values()])
        plan.views.update(zip(host_views, parts))
    if block_table_device is not None:
        plan.views["block_table"] = block_table_device
    else:
        plan.views["block_table"] = plan.views["block_table"].view(plan.batch_size, plan.block_table_host.shape[1])
