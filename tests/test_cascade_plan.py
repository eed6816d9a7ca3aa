"""Cascade planning on the host, against plain references: the leader comparison of the prefix
forest, and the pieces and merge lists of the partition (no kernels)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade_forest import lcp_with_leaders
from paged_backend.cascade_plan import LEAF_FIELDS, NODE_FIELDS, CascadeCost
from tests.test_cascade import check_exact, forest_inputs, random_forest


def lcp_reference(table, rows, leads, start, cap):
    out = np.array(cap, dtype=np.int64)
    for i, (r, ld) in enumerate(zip(rows, leads)):
        neq = np.flatnonzero(table[r, start[i]:cap[i]] != table[ld, start[i]:cap[i]])
        if neq.size:
            out[i] = start[i] + neq[0]
    return out


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("n_runs,per_run", [(1, 1), (3, 2), (1, 400), (40, 9), (12, 60), (300, 1)])
def test_lcp_with_leaders_equals_reference(seed, n_runs, per_run):
    """Runs of rows per leader that share a random depth with it, some rows (or the probe, the
    run's middle row) diverging earlier or later; singleton runs; sizes on both sides of the
    one-pass, probe and chunked paths; int32 and int64 tables."""
    rng = np.random.default_rng(seed * 100 + n_runs + per_run)
    width = int(rng.integers(300, 1500))
    table = rng.integers(0, 1 << 30, size=(n_runs * (per_run + 1), width))
    table = table.astype(np.int64 if seed % 2 else np.int32)
    rows, leads, start = [], [], []
    for g in range(n_runs):
        lead = g * (per_run + 1)
        depth = int(rng.integers(1, width))
        for r in range(lead + 1, lead + per_run + 1):
            d = depth if rng.random() < 0.7 else int(rng.integers(0, width))  # some rows diverge elsewhere
            table[r, :d] = table[lead, :d]
            rows.append(r)
            leads.append(lead)
        start += [int(rng.integers(0, max(1, depth // 2)))] * per_run
    rows, leads, start = np.array(rows), np.array(leads), np.array(start)
    lcp0 = lcp_reference(table, rows, leads, np.zeros_like(start), np.full(rows.size, width))
    start = np.minimum(start, lcp0)  # columns before start must be equal
    cap = np.maximum(start, rng.integers(0, width + 1, size=rows.size))
    assert np.array_equal(lcp_with_leaders(table, rows, leads, start, cap), np.minimum(lcp0, cap))


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
    """Like ``random_forest`` with shared runs of up to 40 blocks, so node segments span several
    tiles and get cut between programs."""
    reqs, nxt = [], [0]

    def node(prefix, depth):
        n = int(rng.integers(0, 41))
        blocks = prefix + list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        for _ in range(int(rng.integers(1, 5))):
            if len(reqs) >= max_requests:
                return
            if depth < max_depth and rng.random() < 0.6:
                node(blocks, depth + 1)
            else:
                tail = int(rng.integers(0, 3))
                reqs.append((blocks + list(range(nxt[0], nxt[0] + tail)), int(rng.integers(0, bs))))
                nxt[0] += tail

    while len(reqs) < 2:
        node([], 1)
    return reqs


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
