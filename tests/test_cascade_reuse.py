"""``plan_cascade(..., forest=, forest_rows=)``: an earlier step's forest reused for a batch that lost
requests (samples that finished) or was reordered; against plans made from scratch and the dense
reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade.plan import CascadeCost
from tests.test_cascade import check_exact, forest_inputs, random_forest
from tests.test_cascade_plan import check_partition, grow, long_forest

pytestmark = pytest.mark.kernel
KEEP_ALL = CascadeCost(0, 0, 0)


def nodes_of(cp):
    return sorted((tuple(int(x) for x in m), s, e) for m, s, e in cp.nodes())


def survivors(rng, bsz: int) -> np.ndarray:
    """Some of ``bsz`` requests (at least one), in a new order."""
    keep = rng.random(bsz) < rng.uniform(0.2, 0.9)
    keep[rng.integers(bsz)] = True
    return rng.permutation(keep.nonzero()[0])


@pytest.mark.parametrize("seed", range(16))
def test_removals_give_the_plan_made_from_scratch(seed):
    """With every shared block kept, the restricted forest is the one found anew for the requests
    left (merged chains included); the partition is valid and the result exact."""
    rng = np.random.default_rng(7000 + seed)
    bs = [4, 16][seed % 2]
    reqs = (long_forest if seed % 4 == 3 else random_forest)(rng, bs, max_depth=1 + seed % 4, max_requests=24)
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu", cost=KEEP_ALL,
              node_programs=[None, 3][seed % 2], leaf_programs=[None, 5][seed % 2])
    first = pb.plan_cascade(bt, lens, **kw)
    rows = survivors(rng, lens.numel())
    table, new_lens = bt[rows].numpy(), lens[rows].numpy()
    got = pb.plan_cascade(table, new_lens, **kw, forest=first, forest_rows=rows)
    want = pb.plan_cascade(table, new_lens, **kw)
    assert nodes_of(got) == nodes_of(want)
    assert np.array_equal(got.shared_len_host, want.shared_len_host)
    if not got.is_flat:
        check_partition(got)
    check_exact(q[rows], k, v, torch.from_numpy(table), torch.from_numpy(new_lens).int(), got, torch.float32)


@pytest.mark.parametrize("seed", range(8))
def test_removals_and_decode_steps_with_the_cost_model(seed):
    """The default cost model over several steps (requests leave, the others grow): nodes that no
    longer pay off fold into their children, the kept ones stay nodes of the batch, exact results."""
    rng = np.random.default_rng(7100 + seed)
    bs = 16
    reqs = long_forest(rng, bs, max_depth=1 + seed % 3, max_requests=32)
    q, k, v, bt, lens = forest_inputs(rng, reqs, bs, 8, 2, 64, torch.float32)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=bs, device="cpu",
              cost=CascadeCost(node_fixed_bytes=0, min_total_bytes=0))
    cp = pb.plan_cascade(bt, lens, **kw)
    nb = k.shape[0]
    for _ in range(3):
        rows = survivors(rng, lens.numel())
        bt, lens, q = bt[rows], lens[rows], q[rows]
        table, new_lens, nb = grow(rng, bt, lens, bs, nb)
        if nb > k.shape[0]:  # room for the new private blocks
            extra = nb - k.shape[0]
            k = torch.cat([k, torch.randn(extra, *k.shape[1:])])
            v = torch.cat([v, torch.randn(extra, *v.shape[1:])])
        cp = pb.plan_cascade(table, new_lens, **kw, forest=cp, forest_rows=rows)
        for members, t0, t1 in cp.nodes():  # each node's members truly share its blocks
            assert members.size >= 2 and t1 > t0
            ids = table[members, t0 // bs: t1 // bs]
            assert np.all(ids == ids[0])
        if not cp.is_flat:
            check_partition(cp)
        bt, lens = torch.from_numpy(table), torch.from_numpy(new_lens).int()
        check_exact(q, k, v, bt, lens, cp, torch.float32)


def test_merges_a_node_left_with_its_parents_members():
    """Prompt P shared by all, each of two sub-prompts by two samples: drop one pair and P and the
    other sub-prompt become one node of the two samples left, as a fresh plan finds."""
    rng = np.random.default_rng(1)
    reqs = [([0, 1, 2, 3], 1), ([0, 1, 2, 3], 2), ([0, 1, 4, 5], 3), ([0, 1, 4, 5], 4)]
    q, k, v, bt, lens = forest_inputs(rng, reqs, 16, 8, 2, 64, torch.float32, shuffle=False)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu", cost=KEEP_ALL)
    first = pb.plan_cascade(bt, lens, **kw)
    assert nodes_of(first) == [((0, 1), 32, 64), ((0, 1, 2, 3), 0, 32), ((2, 3), 32, 64)]
    rows = np.array([3, 2])
    got = pb.plan_cascade(bt[rows], lens[rows], **kw, forest=first, forest_rows=rows)
    assert nodes_of(got) == [((0, 1), 0, 64)]
    check_exact(q[rows], k, v, bt[rows], lens[rows], got, torch.float32)
    alone = pb.plan_cascade(bt[[1]], lens[[1]], **kw, forest=first, forest_rows=[1])
    assert alone.is_flat
    same = pb.plan_cascade(bt, lens, **kw, forest=first, forest_rows=torch.arange(4))  # the same batch
    assert torch.equal(same.buffers, pb.plan_cascade(bt, lens, **kw, forest=first).buffers)


def test_forest_rows_validation():
    rng = np.random.default_rng(2)
    reqs = [([0, 1, 2], 3), ([0, 1, 2], 5), ([0, 1, 4], 0), ([7], 1)]
    _, _, _, bt, lens = forest_inputs(rng, reqs, 16, 8, 2, 64, torch.float32, shuffle=False)
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, device="cpu", cost=KEEP_ALL)
    first = pb.plan_cascade(bt, lens, **kw)
    table, lens_np = bt.numpy(), lens.numpy()
    with pytest.raises(ValueError, match="forest_rows needs forest"):
        pb.plan_cascade(table, lens_np, **kw, forest_rows=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="give forest_rows"):
        pb.plan_cascade(table[:3], lens_np[:3], **kw, forest=first)
    with pytest.raises(ValueError, match="one entry per request"):
        pb.plan_cascade(table[:3], lens_np[:3], **kw, forest=first, forest_rows=[0, 1])
    with pytest.raises(ValueError, match=r"in \[0, 4\), or -1"):
        pb.plan_cascade(table[:2], lens_np[:2], **kw, forest=first, forest_rows=[0, 4])
    with pytest.raises(ValueError, match=r"in \[0, 4\), or -1"):
        pb.plan_cascade(table[:2], lens_np[:2], **kw, forest=first, forest_rows=[0, -2])
    # a request new since forest's step (-1): the forest is found anew, as without forest
    added = np.concatenate([table[[0, 2]], table[[1]]])
    got = pb.plan_cascade(added, lens_np[[0, 2, 1]], **kw, forest=first, forest_rows=[0, 2, -1])
    want = pb.plan_cascade(added, lens_np[[0, 2, 1]], **kw)
    assert nodes_of(got) == nodes_of(want) and torch.equal(got.buffers, want.buffers)
    with pytest.raises(ValueError, match="repeats"):
        pb.plan_cascade(table[:2], lens_np[:2], **kw, forest=first, forest_rows=[1, 1])
    with pytest.raises(TypeError, match="forest_rows must hold integers"):
        pb.plan_cascade(table[:2], lens_np[:2], **kw, forest=first, forest_rows=[0.0, 1.0])
    # rows that do not say where the requests were: the cheap check finds the lost blocks
    with pytest.raises(ValueError, match="no longer holds"):
        pb.plan_cascade(table[[0, 3, 1]], np.full(3, 64), **kw, forest=first, forest_rows=[0, 1, 2])
    with pytest.raises(ValueError, match="which now holds 40"):
        pb.plan_cascade(table[[1, 0]], np.array([40, 51]), **kw, forest=first, forest_rows=[1, 0])
