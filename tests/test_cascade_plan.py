"""Cascade planning on the host, against plain references: the depth comparison of the prefix
forest, and the pieces and merge lists of the partition (no kernels)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade import forest as cf
from paged_backend.cascade import fused as cfused
from paged_backend.cascade import partition as cpart
from paged_backend.cascade.forest import auto_forest
from paged_backend.cascade.plan import LEAF_FIELDS, NODE_FIELDS, CascadeCost
from paged_backend.cascade.planner import CascadePlanner
from paged_backend.decode_plan import cut_pieces
from tests.test_cascade import check_exact, forest_inputs, random_forest


def depth_reference(table, rows, gstart, a, cap):
    """Per group: the smallest first mismatch of a member with the group's first row in [a, cap)."""
    ends = list(gstart[1:]) + [rows.size]
    out = []
    for g, (s, e) in enumerate(zip(gstart, ends)):
        d = int(cap[g])
        for r in rows[s + 1:e]:
            neq = np.flatnonzero(table[r, a[g]:cap[g]] != table[rows[s], a[g]:cap[g]])
            if neq.size:
                d = min(d, int(a[g] + neq[0]))
        out.append(d)
    return np.array(out)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("step", [1, 5, 64])
@pytest.mark.parametrize("groups,size", [(1, 2), (3, 3), (1, 400), (40, 9), (12, 60), (300, 2)])
def test_group_depths_equal_reference(monkeypatch, seed, step, groups, size):
    """Groups whose members share a random depth with the leader, some diverging earlier or later
    (the probe too); groups from column 0; ids past the depth equal by chance; probes sampled
    every few columns or every one, and with a step grown for many groups; int32 and int64."""
    monkeypatch.setattr(cf, "_STEP", step)
    rng = np.random.default_rng(seed * 100 + groups + size)
    width = int(rng.integers(300, 1500))
    table = rng.integers(0, 1 << 30, size=(groups * size, width))
    table = table.astype(np.int64 if seed % 2 else np.int32)
    a = np.zeros(groups, dtype=np.int64)
    for g in range(groups):
        rows = np.arange(g * size, (g + 1) * size)
        depth = int(rng.integers(0, width))
        a[g] = int(rng.integers(0, depth + 1)) if rng.random() < 0.8 else 0
        for r in rows[1:]:
            d = depth if rng.random() < 0.7 else int(rng.integers(0, width))  # some rows diverge elsewhere
            table[r, :max(d, a[g])] = table[rows[0], :max(d, a[g])]
            table[r, d + 1:d + 3] = table[rows[0], d + 1:d + 3]  # equal again just past a mismatch
    perm = rng.permutation(table.shape[0])  # rows scattered over the table
    table[perm] = table.copy()
    rows, gstart = perm, np.arange(0, groups * size, size)
    cap = np.maximum(a, rng.integers(0, width + 1, size=groups))
    assert np.array_equal(cf.group_depths(table, rows, gstart, a, cap), depth_reference(table, rows, gstart, a, cap))


@pytest.mark.parametrize("block", [5, 64, 1 << 16])
@pytest.mark.parametrize("same_range", [False, True])
def test_chain_min_at_range_and_block_edges(monkeypatch, block, same_range):
    """A group's first mismatch at the first or last column of its range, just past it, or
    nowhere; groups of one range (one pass) or of many (blocks in order of their ends); blocks of
    a few ids, so blocks cut groups and spans at odd places; pairs across two groups start
    equal, then differ."""
    monkeypatch.setattr(cf, "_BLOCK", block)
    rng = np.random.default_rng(block + same_range)
    width, n_groups = 41, 30
    size = rng.integers(2, 5, size=n_groups)
    gstart = np.cumsum(size) - size
    table = rng.integers(0, 1 << 30, size=(int(size.sum()), width)).astype(np.int32)
    a = np.full(n_groups, 3) if same_range else rng.integers(1, width - 1, size=n_groups)
    b = np.full(n_groups, width) if same_range else rng.integers(a + 1, width + 1)
    want = np.empty(n_groups, dtype=np.int64)
    for g in range(n_groups):
        m = [a[g], b[g] - 1, b[g], width, int(rng.integers(a[g], b[g]))][g % 5]  # where the group differs
        rows = np.arange(gstart[g], gstart[g] + size[g])
        table[rows[1:], :m] = table[rows[0], :m]
        if m < width:
            table[rows[-1], m] = table[rows[0], m] + 1
        want[g] = min(m, b[g])
    table[:, :a.min()] = table[0, :a.min()]  # so that pairs across groups start equal
    rows = np.arange(table.shape[0])
    assert np.array_equal(cf._chain_min(table, rows, gstart, a, b), want)
    assert np.array_equal(cf.group_depths(table, rows, gstart, a, b), want)


def subgroups_reference(gid, key):
    """Stable runs of equal (gid, key) with >= 2 rows, by sorting Python tuples."""
    gid = np.zeros(key.size, dtype=np.int64) if gid is None else gid
    order = sorted(range(key.size), key=lambda i: (int(gid[i]), int(key[i]), i))
    runs, pos = [], []
    for i in order:
        if pos and (gid[pos[-1]], key[pos[-1]]) == (gid[i], key[i]):
            pos.append(i)
        else:
            runs.append(pos)
            pos = [i]
    runs = [r for r in runs + [pos] if len(r) >= 2]
    sizes = np.array([len(r) for r in runs], dtype=np.int64)
    return np.array(sum(runs, []), dtype=np.int64), np.cumsum(sizes) - sizes, sizes


@pytest.mark.parametrize("dtype,low,high", [(np.int32, -(1 << 31), 1 << 31), (np.uint32, 0, 1 << 32),
                                            (np.int8, -128, 128), (np.int64, 1 << 40, (1 << 40) + 50),
                                            (np.int64, -(1 << 62), 1 << 62)])
@pytest.mark.parametrize("groups", [None, 1, 7])
def test_subgroups_equal_reference(dtype, low, high, groups):
    """(group, id, position) packed into one int64 for ids of <= 32 bits or a small range, else
    a lexsort; extreme ids, few distinct ids so that runs form."""
    rng = np.random.default_rng(groups or 0)
    n = 300
    ids = rng.integers(low, high, size=12, dtype=np.int64).astype(dtype)
    if high - low == 1 << (8 * np.dtype(dtype).itemsize):  # the dtype's whole range: its extremes too
        ids[:2] = np.iinfo(dtype).min, np.iinfo(dtype).max
    key = ids[rng.integers(0, ids.size, size=n)]
    gid = None if groups is None else np.sort(rng.integers(0, groups, size=n))
    for got, want in zip(cf._subgroups(gid, key), subgroups_reference(gid, key)):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("differ", [False, True])
def test_forest_mismatch_in_the_last_full_block(differ):
    """Rows 0, 1 have 8 full blocks, equal up to the last one and (``differ``) not in it; rows 2, 3
    have 7, equal in their partial block too, which is never shared."""
    table = np.tile(np.arange(10, dtype=np.int32), (4, 1))
    if differ:
        table[1, 7] = 99
    full = np.array([8, 8, 7, 7])
    ptr, members, start, end, level, kd = auto_forest(table, full, lambda n, own: np.ones(np.shape(n), dtype=bool))
    nodes = [(members[ptr[k]:ptr[k + 1]].tolist(), int(start[k]), int(end[k]), int(level[k])) for k in range(end.size)]
    assert nodes == [([0, 1, 2, 3], 0, 7, 0)] + ([] if differ else [([0, 1], 7, 8, 1)])
    assert np.array_equal(kd, [7, 7, 7, 7] if differ else [8, 8, 7, 7])


def check_partition(cp):
    """Every (node, kv_head) token range and every tail is covered once by pieces, and each
    (request, kv_head) merge list holds exactly its slots: node slots first, each ascending."""
    hkv, bsz = cp.num_kv_heads, cp.batch_size
    v = {k: t.numpy().astype(np.int64) for k, t in cp.views.items()}
    nw, lw = v["node_work"].reshape(-1, NODE_FIELDS), v["leaf_work"].reshape(-1, LEAF_FIELDS)
    members = cp.node_members
    lists = [[[], []] for _ in range(bsz * hkv)]
    covered = {}
    for rep, kvh, mbase, n_in, t0, t1, slot in nw:
        for j in range(n_in):
            lists[members[mbase + j] * hkv + kvh][0].append(slot + j)
            covered.setdefault((members[mbase + j], kvh), []).append((t0, t1))
    for req, kvh, t0, t1, slot in lw:
        lists[req * hkv + kvh][1].append(slot)
        covered.setdefault((req, kvh), []).append((t0, t1))
    for (req, kvh), spans in covered.items():  # node ranges then the tail tile [0, seq_len)
        spans = sorted(spans)
        assert spans[0][0] == 0 and spans[-1][1] == cp.seq_lens_host[req]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    want = [s for node, leaf in lists for s in sorted(node) + sorted(leaf)]
    counts = [len(node) + len(leaf) for node, leaf in lists]
    assert np.array_equal(v["req_ptr"], np.concatenate([[0], np.cumsum(counts)]))
    assert np.array_equal(v["slots"], want)
    assert sorted(want) == list(range(cp.num_slots))


def long_forest(rng, bs: int, max_depth: int, max_requests: int):
    """``random_forest`` with shared runs of up to 40 blocks, so node segments span several tiles
    and get cut between programs."""
    return random_forest(rng, bs, max_depth, max_requests, max_shared=40, max_children=4, min_requests=2)


@pytest.mark.parametrize("seed", range(30))
def test_partition_equals_reference(seed):
    """Random forests, few programs so that node and tail segments are cut into several pieces."""
    rng = np.random.default_rng(3000 + seed)
    bs = [4, 16, 64][seed % 3]
    reqs = (long_forest if seed % 2 else random_forest)(rng, bs, max_depth=1 + seed % 4, max_requests=24)
    hq, hkv = [(4, 4), (8, 2), (12, 3), (8, 1)][seed % 4]
    _, _, _, bt, lens = forest_inputs(rng, reqs, bs, hq, hkv, 64, torch.float32)
    programs = [(None, None), (3, 5), (7, 2)][seed % 3]
    cp = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=bs, device="cpu",
                         cost=CascadeCost(0, 0, 0), node_programs=programs[0], leaf_programs=programs[1])
    if not cp.is_flat:
        check_partition(cp)


def check_fused(cp):
    """The Hopper kernel's runs of tail pieces (``fused_prog_ptr``): program ``g`` runs node program ``g``'s
    pieces and beside them tail pieces ``fused_prog_ptr[g] ..`` (runs in piece order, so every piece runs
    once); the decode kernel's programs take runs of the same tail pieces."""
    v = {k: t.numpy().astype(np.int64) for k, t in cp.views.items()}
    ptr, nprog, lprog = v["fused_prog_ptr"], v["node_prog_ptr"], v["leaf_prog_ptr"]
    n_leaf = cp.num_leaf_pieces
    assert ptr.size == nprog.size == cp.node_programs + 1
    assert ptr[0] == 0 and ptr[-1] == n_leaf and (np.diff(ptr) >= 0).all()
    starts, lens = cp.tail_start(), cp.seq_lens_host
    live = lens > starts
    cut = cut_pieces(-(-(lens[live] - starts[live]) // cp.block_n), cp.node_programs, cp.num_kv_heads)
    assert np.array_equal(ptr, cut[2])  # the stream-K cut of the tails over the node grid: equal tiles a program
    assert lprog.size == cp.leaf_programs + 1 and lprog[0] == 0 and lprog[-1] == n_leaf
    assert (np.diff(lprog) >= 0).all()


def fused_expected(cp, bs):
    """Whether ``cp`` (planned as on Hopper, 128-row tiles) should have fused lists: nodes and tails,
    and every tail piece on a page box when the tails are cut over the node programs."""
    if not (cp.num_node_pieces and cp.num_leaf_pieces):
        return False
    starts, lens = cp.tail_start(), cp.seq_lens_host
    live = lens > starts
    cut_off = cut_pieces(-(-(lens[live] - starts[live]) // cp.block_n), cp.node_programs, cp.num_kv_heads)[4]
    return not (cut_off * cp.block_n % min(bs, 64)).any()


@pytest.mark.parametrize("seed", range(12))
def test_fused_lists(monkeypatch, seed):
    """Plans as on Hopper (128-row node tiles there): the lists of node and tail pieces per node
    program, with the partition itself complete; none where a tail piece would start inside a page
    box (pages of 64, tails cut at 32 keys)."""
    monkeypatch.setattr(cfused, "use_sm90", lambda device: True)
    monkeypatch.setattr(cpart, "choose_block_m", lambda *a, **k: 128)
    rng = np.random.default_rng(5000 + seed)
    bs = [16, 32, 64][seed % 3]
    reqs = long_forest(rng, bs, max_depth=1 + seed % 3, max_requests=40)
    hq = [8, 32][seed % 2]  # 128-row tiles of 32 requests (group 4) or 8 (group 16)
    _, _, _, bt, lens = forest_inputs(rng, reqs, bs, hq, 2, 64, torch.float32)
    programs = [(None, None), (3, 5), (7, 2), (5, 16)][seed % 4]
    cp = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu",
                         cost=CascadeCost(0, 0, 0), node_programs=programs[0], leaf_programs=programs[1])
    if cp.is_flat:
        return
    check_partition(cp)
    assert ("fused_prog_ptr" in cp.views) == fused_expected(cp, bs)
    if "fused_prog_ptr" in cp.views:
        check_fused(cp)


@pytest.mark.parametrize("units,n_seg,k", [(8, 3, 2), (12, 4, 3), (7, 2, 3), (5, 5, 5), (9, 6, 1)])
def test_lockstep_pieces(units, n_seg, k):
    """``k`` pieces per segment, piece ``i`` on program ``i``, the programs past them empty; where
    ``k`` divides the units these are stream-K's own cuts over ``k * n_seg`` programs."""
    grid = n_seg * k + 2
    seg, seg_ptr, prog, cut_at, cut_off = cfused.lockstep_pieces(units, n_seg, k, grid)
    assert seg.tolist() == [s for s in range(n_seg) for _ in range(k)]
    assert seg_ptr.tolist() == list(range(0, n_seg * k + 1, k))
    assert prog.tolist() == list(range(n_seg * k + 1)) + [n_seg * k] * 2
    assert cut_at.tolist() == [p for p in range(n_seg * k) if p % k]
    assert cut_off.tolist() == [(p % k) * units // k for p in cut_at.tolist()]
    if units % k == 0:
        want = cut_pieces(np.array([units]), n_seg * k, np.array([n_seg]))
        got = (seg, seg_ptr, prog[:n_seg * k + 1], cut_at, cut_off)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("units,per_node,grid,k", [
    ([512], [64], 132, 2),  # 32768/256/256: 8 KV heads x 8 row blocks
    ([128], [16], 132, 8),  # 8192/64/256
    ([64, 64], [8, 8], 132, 8),  # two nodes of one length
    ([512], [48], 132, 0),  # 96 of 132 programs: too few
    ([1], [16], 132, 0),  # one tile a segment: 16 programs
    ([64, 32], [8, 8], 132, 0),  # nodes of two lengths
    ([512], [140], 132, 0),  # more segments than programs
])
def test_lockstep(units, per_node, grid, k):
    assert cfused.lockstep(np.array(units), np.array(per_node), grid) == k


def prefix_forest(n: int, shared: int, private: int):
    """``n`` requests sharing ``shared`` blocks, each with one private block and ``private`` tokens."""
    return [(list(range(shared)) + [shared + i], private) for i in range(n)]


@pytest.mark.parametrize("hopper", [False, True])
def test_lockstep_plan(monkeypatch, hopper):
    """One shared prefix: 40 requests of group 16 are 5 row blocks of 128 rows per KV head (10 node
    segments of 3 tiles). As on Hopper (fused lists) the plan takes 128-row tiles whatever the tile
    choice says, and 22 node programs take 2 pieces of every segment, piece ``i`` on program ``i``, the
    row blocks of a KV head on the same keys. Elsewhere the choice stands and stream-K cuts."""
    chosen = []
    monkeypatch.setattr(cfused, "use_sm90", lambda device: hopper)
    monkeypatch.setattr(cpart, "choose_block_m", lambda *a, **kw: chosen.append(kw["wide"]) or 256)
    rng = np.random.default_rng(7)
    _, _, _, bt, lens = forest_inputs(rng, prefix_forest(40, 12, 5), 16, 32, 2, 64, torch.float32)
    cp = pb.plan_cascade(bt, lens, num_q_heads=32, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                         cost=CascadeCost(0, 0, 0, wide_tile_flops=0), node_programs=22)
    check_partition(cp)
    assert ("fused_prog_ptr" in cp.views) == hopper
    nw = cp.views["node_work"].numpy()
    if not hopper:
        assert chosen == [True] and cp.block_m == 256
        assert cp.views["node_prog_ptr"].tolist() == cut_pieces(np.array([3]), 22, np.array([6]))[2].tolist()
        return
    check_fused(cp)
    assert chosen == [] and cp.block_m == 128 and cp.num_node_pieces == 20
    assert cp.views["node_prog_ptr"].tolist() == list(range(21)) + [20, 20]
    rb = nw[:, 2] // 8  # (kv_head, row block) segment order, two pieces each
    assert nw[:, 1].tolist() == [h for h in range(2) for _ in range(10)]
    assert rb.tolist() == [r for _ in range(2) for r in range(5) for _ in range(2)]
    assert nw[:, 4:6].tolist() == [[0, 64], [64, 192]] * 10


UNCOVERED = {  # Hq, Hkv, D, page, requests, bytes a cache value (the cost model's)
    "d256": (32, 2, 256, 16, 40, 2), "pages of 8": (32, 2, 64, 8, 40, 2), "group 3": (12, 4, 64, 16, 40, 2),
    "fp8, 64 rows a node": (32, 2, 64, 16, 4, 1)}


@pytest.mark.parametrize("what", list(UNCOVERED))
def test_no_hopper_tiles_where_the_hopper_kernel_cannot_run(monkeypatch, what):
    """Plans the Hopper kernel would not run (head size 256, pages of 8, a group of 3) or would run slower (1-byte
    caches by the cost model with fewer than 128 rows a node): no fused lists, the portable kernels' tile choice
    and stream-K cuts."""
    monkeypatch.setattr(cfused, "use_sm90", lambda device: True)
    hq, hkv, d, bs, n, elem = UNCOVERED[what]
    rng = np.random.default_rng(7)
    _, _, _, bt, lens = forest_inputs(rng, prefix_forest(n, 24 * 16 // bs, 5), bs, hq, hkv, d, torch.float32)
    cp = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, device="cpu",
                         cost=CascadeCost(0, 0, 0, kv_elem_bytes=elem), node_programs=22)
    check_partition(cp)
    gp = 1 << (hq // hkv - 1).bit_length()
    assert "fused_prog_ptr" not in cp.views
    assert cp.block_m == cpart.choose_block_m(np.array([n * gp]), cp.node_end - cp.node_start, gp, d)


@pytest.mark.parametrize("hopper,fused_flops", [(False, 2.0 ** 27), (True, 2.0 ** 27), (True, 2.0 ** 21)])
def test_fp8_lockstep_plan(monkeypatch, hopper, fused_flops):
    """1-byte caches (the cost model's) on Hopper, one shared prefix of 40 requests of group 16 (640 rows, 2.9e6
    node GEMM FLOPs a node program): the Hopper node kernel's 128-row tiles in lockstep as over 16-bit caches
    (test_lockstep_plan), with fused lists up to the cost model's ``fp8_fused_flops`` (else the tails are cut over
    the tail programs). Elsewhere the tile choice and no fused lists."""
    monkeypatch.setattr(cfused, "use_sm90", lambda device: hopper)
    rng = np.random.default_rng(7)
    _, _, _, bt, lens = forest_inputs(rng, prefix_forest(40, 12, 5), 16, 32, 2, 64, torch.float32)
    cp = pb.plan_cascade(bt, lens, num_q_heads=32, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                         cost=CascadeCost(0, 0, 0, kv_elem_bytes=1, fp8_fused_flops=fused_flops), node_programs=22,
                         leaf_programs=6)
    check_partition(cp)
    fused = hopper and fused_flops > 2.9e6
    assert ("fused_prog_ptr" in cp.views) == fused
    if not hopper:
        assert cp.block_m == cpart.choose_block_m(np.array([640]), cp.node_end - cp.node_start, 16, 64)
        return
    assert cp.block_m == 128 and cp.num_node_pieces == 20
    assert cp.views["node_prog_ptr"].tolist() == list(range(21)) + [20, 20]
    assert cp.views["node_work"].numpy()[:, 4:6].tolist() == [[0, 64], [64, 192]] * 10
    lens_live = cp.seq_lens_host - cp.tail_start()
    if fused:
        check_fused(cp)
        assert cp.views["fused_prog_ptr"].tolist() == cut_pieces(-(-lens_live // cp.block_n), 22, 2)[2].tolist()
    else:
        assert cp.views["leaf_prog_ptr"].tolist() == cut_pieces(-(-lens_live // cp.block_n), 6, 2)[2].tolist()


@pytest.mark.parametrize("hq,bs,elem,hopper,per_sm", [
    (32, 16, 1, True, 3),  # fp8 on Hopper: the Hopper decode kernel runs the tails, 3 programs an SM
    (32, 16, 2, True, 4), (32, 16, 1, False, 4),
    (32, 64, 1, True, 4),  # pages of 64: the tails' 32-key cuts would split a page box
    (64, 16, 1, True, 4),  # group 32: the portable decode kernel's tails
])
def test_tail_grid(monkeypatch, hq, bs, elem, hopper, per_sm):
    """The tails' grid: 3 programs an SM where the Hopper decode kernel runs them (cascade.fused.hopper_tails:
    it spills at the portable tails' 4), else 4."""
    from paged_backend import decode_plan
    monkeypatch.setattr(cfused, "use_sm90", lambda device: hopper)
    monkeypatch.setattr(decode_plan, "use_sm90", lambda device: hopper)
    rng = np.random.default_rng(7)
    _, _, _, bt, lens = forest_inputs(rng, prefix_forest(8, 256 // bs, 5), bs, hq, 2, 128, torch.float32)
    cp = pb.plan_cascade(bt, lens, num_q_heads=hq, num_kv_heads=2, head_dim=128, block_size=bs, device="cpu",
                         cost=CascadeCost(0, 0, 0, kv_elem_bytes=elem))
    check_partition(cp)
    assert not cp.is_flat and cp.leaf_programs == 4 * per_sm  # (4 "SMs" on the CPU)
    assert cfused.hopper_tails(cp, elem) == (per_sm == 3)


def test_fp8_flat_fallback_takes_the_fp8_decode_plan(monkeypatch):
    """A cascade plan that falls back to flat decode over a 1-byte cache (the cost model's) plans it as
    ``plan_decode`` plans an fp8 cache: 3 programs an SM where the Hopper decode kernel runs it."""
    from paged_backend import decode_plan
    monkeypatch.setattr(decode_plan, "use_sm90", lambda device: True)
    rng = np.random.default_rng(7)
    _, _, _, bt, lens = forest_inputs(rng, prefix_forest(4, 2, 5), 16, 32, 8, 128, torch.float32)
    for elem, per_sm in ((1, 3), (2, 2)):
        cp = pb.plan_cascade(bt, lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cpu",
                             cost=CascadeCost(kv_elem_bytes=elem))
        assert cp.is_flat and cp.flat_plan.num_programs == 4 * per_sm  # (4 "SMs" on the CPU)


@pytest.mark.kernel
def test_lockstep_plan_exact(monkeypatch):
    """The lockstep pieces (planned as on Hopper) run exactly on the portable kernels."""
    monkeypatch.setattr(cfused, "use_sm90", lambda device: True)
    rng = np.random.default_rng(8)
    q, k, v, bt, lens = forest_inputs(rng, prefix_forest(40, 12, 5), 16, 32, 2, 64, torch.float32)
    cp = pb.plan_cascade(bt, lens, num_q_heads=32, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                         cost=CascadeCost(0, 0, 0), node_programs=22)
    assert cp.num_node_pieces == 20 and "fused_prog_ptr" in cp.views
    check_exact(q, k, v, bt, lens, cp, torch.float32)


@pytest.mark.kernel
def test_requests_wholly_in_nodes():
    """Block-aligned requests with no private blocks leave no tail pieces (this used to raise)."""
    rng = np.random.default_rng(4)
    reqs = [([0, 1], 0), ([0, 1], 0), ([0, 1, 2], 0), ([0, 1, 2], 0)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, 16, 8, 2, 64, torch.float32)
    cp = pb.plan_cascade(bt, lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
                         cost=CascadeCost(0, 0, 0), node_programs=3, leaf_programs=4)
    assert cp.num_nodes == 2 and cp.num_leaf_pieces == 0
    assert np.array_equal(cp.views["leaf_prog_ptr"].numpy(), np.zeros(5))
    check_partition(cp)
    check_exact(q, k, v, bt, lens, cp, torch.float32)


def grow(rng, bt, lens, bs, nb):
    """A decode step of 1-40 tokens per request: new private blocks (ids from ``nb`` up) appended
    where a request crosses a block boundary. -> (table [B, cols] int32, lens, block count)."""
    new_lens = lens.numpy() + rng.integers(1, 41, size=lens.numel())
    need = -(-new_lens // bs)
    table = np.zeros((lens.numel(), max(int(need.max()), bt.shape[1])), dtype=np.int32)
    table[:, :bt.shape[1]] = bt.numpy()
    for i, n in enumerate(need):  # (plain loop: a test)
        have = -(-int(lens[i]) // bs)
        table[i, have:n] = np.arange(nb, nb + n - have)
        nb += n - have
    return table, new_lens, nb


@pytest.mark.kernel
@pytest.mark.parametrize("seed", range(8))
def test_forest_reuse_after_decode_steps(seed):
    """Two decode steps planned with ``forest=`` the first plan: the same nodes, a partition valid
    for the new lengths, the exact result; a fresh plan may share more (full blocks are new)."""
    rng = np.random.default_rng(5000 + seed)
    bs = [4, 16][seed % 2]
    reqs = (long_forest if seed % 2 else random_forest)(rng, bs, max_depth=1 + seed % 3, max_requests=16)
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu", cost=CascadeCost(0, 0, 0))
    first = pb.plan_cascade(bt, lens, **kw)
    nb = k.shape[0]
    for _ in range(2):
        table, new_lens, nb = grow(rng, bt, lens, bs, nb)
        k = torch.cat([k, torch.randn(nb - k.shape[0], *k.shape[1:])])
        v = torch.cat([v, torch.randn(nb - v.shape[0], *v.shape[1:])])
        cp = pb.plan_cascade(table, new_lens, **kw, forest=first, node_programs=3, leaf_programs=5)
        assert np.array_equal(cp.node_members, first.node_members) and np.array_equal(cp.node_end, first.node_end)
        assert np.array_equal(cp.shared_len_host, first.shared_len_host)
        if not cp.is_flat:
            check_partition(cp)
        check_exact(q, k, v, torch.from_numpy(table), torch.from_numpy(new_lens.astype(np.int32)), cp, torch.float32)
        bt, lens = torch.from_numpy(table), torch.from_numpy(new_lens)


@pytest.mark.kernel
@pytest.mark.parametrize("seed", range(6))
def test_host_table_a_step_late(seed):
    """``host_lens``: a host table holding each row's blocks as of a step before (the rest zeros in
    every row, which read as blocks shared by all) plans steps exact on the kernels' table: the
    shared blocks found are those of the blocks held, fresh and carried over (``forest=``); a forest
    sharing blocks the host table no longer holds is refused as not held."""
    rng = np.random.default_rng(7000 + seed)
    bs = [4, 16][seed % 2]
    reqs = (long_forest if seed % 2 else random_forest)(rng, bs, max_depth=1 + seed % 3, max_requests=16)
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu", cost=CascadeCost(0, 0, 0))
    forest, nb = None, k.shape[0]
    for _ in range(3):
        table, new_lens, nb = grow(rng, bt, lens, bs, nb)
        k = torch.cat([k, torch.randn(nb - k.shape[0], *k.shape[1:])])
        v = torch.cat([v, torch.randn(nb - v.shape[0], *v.shape[1:])])
        late = np.zeros_like(table)  # the host's copy: last step's blocks only
        late[:, :bt.shape[1]] = bt.numpy()
        held = -(-lens.numpy() // bs) * bs
        late[np.arange(table.shape[1])[None, :] >= (held // bs)[:, None]] = 0
        dev = torch.from_numpy(table)
        for carried in (None, forest):
            cp = pb.plan_cascade(late, new_lens, **kw, block_table_device=dev, host_lens=held, forest=carried)
            private = (1 << 24) + np.arange(table.size).reshape(table.shape)  # ids no two entries share
            ref = pb.plan_cascade(np.where(np.arange(table.shape[1])[None, :] < (held // bs)[:, None], table,
                                           private).astype(np.int32),
                                  new_lens, **kw, block_table_device=dev, forest=carried) if carried is None else cp
            assert np.array_equal(cp.shared_len_host, ref.shared_len_host)  # as if the rest were all private
            assert (cp.shared_len_host <= np.minimum(held, new_lens)).all()
            check_exact(q, k, v, dev, torch.from_numpy(new_lens.astype(np.int32)), cp, torch.float32)
        forest, bt, lens = cp, dev, torch.from_numpy(new_lens)
    q, k, v, bt, lens = forest_inputs(rng, prefix_forest(8, 4, 2), 16, 8, 2, 64, torch.float32)
    kw["block_size"] = 16
    forest = pb.plan_cascade(bt, lens, **kw)
    assert forest.num_nodes
    with pytest.raises(ValueError, match="shares"):  # the forest's blocks beyond what the host holds
        pb.plan_cascade(bt, lens, **kw, block_table_device=bt, host_lens=np.zeros(lens.numel(), np.int64), forest=forest)
    late, held = bt.numpy(), lens.numpy()
    with pytest.raises(ValueError, match="host_lens needs block_table_device"):
        pb.plan_cascade(late, held, **kw, host_lens=held)
    with pytest.raises(ValueError, match="host_lens must hold"):
        pb.plan_cascade(late, held, **kw, block_table_device=bt, host_lens=held[:-1])


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_forest_reuse_copies_the_partition_only_when_equal(monkeypatch, seed, hopper):
    """A grown step planned with ``forest=``: where only the tails' lengths changed the partition is
    copied, else made anew; either way it equals the one made from scratch (bit for bit). ``hopper``:
    planned as on Hopper with 128-row tiles (fused lists)."""
    if hopper:
        monkeypatch.setattr(cfused, "use_sm90", lambda device: True)
        monkeypatch.setattr(cpart, "choose_block_m", lambda *a, **k: 128)
    rng = np.random.default_rng(6000 + seed)
    bs = [4, 16][seed % 2]
    reqs = (long_forest if seed % 2 else random_forest)(rng, bs, max_depth=1 + seed % 3, max_requests=40)
    _, _, _, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32)
    programs = [(None, None), (3, 5), (64, 512)][seed % 3]
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu", cost=CascadeCost(0, 0, 0),
              node_programs=programs[0], leaf_programs=programs[1])
    first = pb.plan_cascade(bt, lens, **kw)
    table, new_lens, _ = grow(rng, bt, lens, bs, 1 << 20)
    new_lens[::3] = lens.numpy()[::3]  # some requests unchanged, some may now hold a tail
    copied = []
    same_tails = cpart._same_tails
    monkeypatch.setattr(cpart, "_same_tails", lambda *a: copied.append(same_tails(*a)) or copied[-1])
    got = pb.plan_cascade(table, new_lens, **kw, forest=first)
    monkeypatch.setattr(cpart, "_same_tails", lambda *a: False)
    want = pb.plan_cascade(table, new_lens, **kw, forest=first)
    assert first.is_flat or len(copied) == 1
    assert torch.equal(got.buffers, want.buffers) and got.views.keys() == want.views.keys()
    for name in ("block_m", "node_programs", "leaf_programs", "num_node_pieces", "num_leaf_pieces", "num_slots",
                 "max_merge_len"):
        assert getattr(got, name) == getattr(want, name)


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("programs", [(64, 64), (200, 200)])
def test_decode_steps_of_cut_tails_copy_the_partition(monkeypatch, programs, hopper):
    """Samples of one prompt, one token a step, their tails cut over more programs than they have
    (1, then 2 and 3 pieces a tail as they reach new tiles): a step whose tails keep their tiles
    copies the partition (only each tail's last piece ends later); either way it equals the
    partition made from scratch, bit for bit."""
    if hopper:
        monkeypatch.setattr(cfused, "use_sm90", lambda device: True)
        monkeypatch.setattr(cpart, "choose_block_m", lambda *a, **k: 128)
    from tests.test_cascade_arena import steps_of_samples
    bs, n, hkv = 16, 12, 2
    steps, _ = steps_of_samples(bs, 24, n, prompt=9 * bs + 3, steps=80)
    kw = dict(num_q_heads=8, num_kv_heads=hkv, head_dim=64, block_size=bs, device="cpu", cost=CascadeCost(0, 0, 0),
              node_programs=programs[0], leaf_programs=programs[1])
    same_tails = cpart._same_tails
    prev, cut_and_copied = None, 0
    for table, lens in steps:
        copied = []
        monkeypatch.setattr(cpart, "_same_tails", lambda *a: copied.append(same_tails(*a)) or copied[-1])
        got = pb.plan_cascade(table, lens, **kw, forest=prev)
        monkeypatch.setattr(cpart, "_same_tails", lambda *a: False)
        want = pb.plan_cascade(table, lens, **kw, forest=prev) if prev is not None else got
        assert torch.equal(got.buffers, want.buffers) and got.num_leaf_pieces == want.num_leaf_pieces
        check_partition(got)
        tiles = -(-(lens[0] - 9 * bs) // got.block_n)  # each tail's tiles (all samples alike)
        if prev is not None and tiles == -(-(prev.seq_lens_host[0] - 9 * bs) // got.block_n):
            assert copied == [True]  # the same tiles a tail: copied
            cut_and_copied += got.num_leaf_pieces > n * hkv
        prev = got
    assert cut_and_copied >= 40 and ("fused_prog_ptr" in got.host) == hopper


def test_forest_reuse_rejects_a_changed_batch(monkeypatch):
    rng = np.random.default_rng(7)
    reqs = [([0, 1, 2], 3), ([0, 1, 2], 5), ([0, 1, 4], 0), ([7], 1)]
    _, _, _, bt, lens = forest_inputs(rng, reqs, 16, 8, 2, 64, torch.float32, shuffle=False)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu", cost=CascadeCost(0, 0, 0))
    first = pb.plan_cascade(bt, lens, **kw)
    assert first.num_nodes == 2 and int(first.shared_len_host[0]) == 48
    table, lens_np = bt.numpy().copy(), lens.numpy()
    with pytest.raises(TypeError, match="^forest must be a CascadePlan"):
        pb.plan_cascade(table, lens_np, **kw, forest="plan")
    with pytest.raises(ValueError, match="groups or forest"):
        pb.plan_cascade(table, lens_np, **kw, forest=first, groups=[[0, 1]])
    with pytest.raises(ValueError, match="batch_size=4, this step has 3"):
        pb.plan_cascade(table[:3], lens_np[:3], **kw, forest=first)
    with pytest.raises(ValueError, match="head_dim=64, this step has 128"):
        pb.plan_cascade(table, lens_np, **{**kw, "head_dim": 128}, forest=first)
    short = lens_np.copy()
    short[1] = 40  # below its 48 shared tokens
    with pytest.raises(ValueError, match="request 1, which now holds 40"):
        pb.plan_cascade(table, short, **kw, forest=first)
    swapped = table[[0, 3, 2, 1]]  # the batch reordered: row 1 lost the node's blocks
    with pytest.raises(ValueError, match="row 1 no longer holds"):
        pb.plan_cascade(swapped, np.full(4, 64), **kw, forest=first)
    inner = table.copy()
    inner[1, 0] = 99  # a change inside the shared range, not in its last block
    pb.plan_cascade(inner, lens_np, **kw, forest=first)  # the cheap check looks at the last shared block only
    monkeypatch.setenv("PAGED_BACKEND_DEBUG", "1")
    with pytest.raises(ValueError, match="row 1 no longer holds"):
        pb.plan_cascade(inner, lens_np, **kw, forest=first)


def test_planner_carries_the_forest_by_ids():
    """CascadePlanner: the same ids reuse the last forest whole, a subset restricts it, a new id plans
    anew; a forest the table no longer holds raises unless ``checked`` (rows known by place), which
    plans anew. Each plan's nodes are a fresh plan's."""
    bs, dev = 16, torch.device("cpu")
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device=dev)
    table = np.arange(6 * 8, dtype=np.int32).reshape(6, 8) + 100
    table[:4, :4] = np.arange(4)  # rows 0-3 share 4 blocks, rows 4-5 their first 2
    table[4:, :2] = np.arange(50, 52)
    cost = CascadeCost(0, 0, 0)

    def nodes(plans):
        p = plans[None]
        return np.diff(p.node_ptr).tolist(), p.node_members.tolist()

    def fresh(t, lens):
        return nodes({None: pb.plan_cascade(t, lens, cost=cost, **shape)})
    planner = CascadePlanner(**shape)
    lens = np.full(6, 6 * bs + 3, np.int64)
    every = [10, 11, 12, 13, 14, 15]  # the rows' ids
    for step, ids in enumerate((every, every, [10, 12, 13, 14])):
        rows = [every.index(i) for i in ids]
        t, n = table[rows], lens[rows] + step
        got = planner.plans(t, n, np.array(ids), torch.from_numpy(t), cost)
        assert nodes(got) == fresh(t, n) and planner.reused == step
    assert nodes(planner.plans(table[:3], lens[:3], np.array([10, 11, 99]), torch.from_numpy(table[:3]), cost)) == \
        fresh(table[:3], lens[:3]) and planner.reused == 2  # a new id: planned anew
    moved = table[[4, 5, 0]]  # the same ids, other rows in their places
    with pytest.raises(ValueError, match="no longer holds"):
        planner.plans(moved, lens[:3], np.array([10, 11, 99]), torch.from_numpy(moved), cost)
    planner.plans(table[:3], lens[:3], np.array([10, 11, 99]), torch.from_numpy(table[:3]), cost)
    got = planner.plans(moved, lens[:3], np.array([10, 11, 99]), torch.from_numpy(moved), cost, checked=True)
    assert nodes(got) == fresh(moved, lens[:3]) and planner.reused == 3


def test_used_id_bounds_read_each_rows_used_entries_only():
    """The block-id bounds a plan checks: the max and (negative) min over each row's used entries only,
    whatever lies after them, for rows of one length (a decode step) and ragged ones."""
    from paged_backend.cascade.plan import _used_id_bounds
    rng = np.random.default_rng(3)
    for _ in range(200):
        b, c = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        table = rng.integers(-3, 50, (b, c)).astype(np.int32)
        blocks = np.full(b, c) if rng.random() < 0.3 else rng.integers(1, c + 1, b)
        used = np.arange(c)[None, :] < blocks[:, None]
        want = int(np.max(table, where=used, initial=-1)), int(np.min(table, where=used, initial=0))
        assert _used_id_bounds(table, blocks) == want
