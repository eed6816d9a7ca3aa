"""Sliding-window attention (``window``: the query at position ``p`` attends the keys at
``p - window < pos <= p``) in decode (planned, from upper bounds, unplanned), cascade (nodes
trimmed to their members' windows, nodes no window reaches dropped, tails from the window) and
prefill (chunks longer and shorter than the window), on both CPU paths and the GPU, against the
fp64 dense reference; the work follows the window; bad values raise errors naming the argument."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import paged_backend as pb
from paged_backend.cascade.plan import CascadeCost
from tests.paged_inputs import make_block_table, make_cache, make_decode_inputs
from tests.reference import assert_close_state, decode_reference, prefill_reference, rel_err

pytestmark = pytest.mark.kernel
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HQ, HKV, D, BS = 8, 2, 64, 16


def _plan(lens, device, **kw):
    return pb.plan_decode(np.array(lens), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                          device=device, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 16, 37, 150])
@pytest.mark.parametrize("planning", ["exact", "upper", "split", "none"])
def test_decode(device, dtype, window, planning):
    lens = [0, 1, 36, 37, 38, 150, 151, 300, 5]
    q, k, v, bt, sl = make_decode_inputs(lens, HQ, HKV, D, BS, dtype, device)
    plan = {"exact": lambda: _plan(lens, device, window=window),
            "upper": lambda: _plan([n + 40 for n in lens], device, window=window),  # as vLLM's upper bounds
            "split": lambda: _plan(lens, device, window=window, mode="split", num_programs=7, block_n=16),
            "none": lambda: None}[planning]()
    if planning == "upper":  # the table must hold the bound
        bt = torch.cat([bt, bt[:, -1:].expand(-1, 3)], 1).contiguous()
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=plan, window=window)
    ref = decode_reference(q, k, v, bt, sl, window=window)
    assert_close_state(out, lse, *ref, dtype)
    assert rel_err(ref[0], decode_reference(q, k, v, bt, sl)[0]) > 0.05  # the window matters here


def test_decode_plan_follows_the_window():
    """A 128K context with a 4096 window: the plan's pieces cover 4096 tokens per segment."""
    lens = np.array([131072, 70000, 100])
    plan = _plan(lens, "cpu", window=4096)
    work = plan.work[:plan.num_pieces].numpy()
    covered = np.zeros((3, HKV), np.int64)
    np.add.at(covered, (work[:, 0], work[:, 1]), work[:, 3] - work[:, 2])
    assert (covered == np.minimum(lens, 4096)[:, None]).all()
    plan.update(lens + 1)  # the next step: the same work (the window's size is unchanged)
    work2 = plan.work[:plan.num_pieces].numpy()
    assert np.array_equal(work, work2)


def test_decode_graph_step_with_window():
    """update() refills a window plan in place; decode stays exact as the window slides."""
    lens = [20, 90]
    q, k, v, bt, sl = make_decode_inputs([n + 3 for n in lens], HQ, HKV, D, BS, torch.float32)
    plan = _plan(lens, "cpu", window=32)
    for step in range(3):
        cur = torch.tensor([n + step for n in lens], dtype=torch.int32)
        plan.update(cur.numpy())
        out, lse = pb.paged_decode(q, k, v, bt, cur, plan=plan, window=32)
        assert_close_state(out, lse, *decode_reference(q, k, v, bt, cur, window=32), torch.float32)


def _shared_inputs(device, dtype, tails):
    """Requests 0-5 share blocks 0-3; requests 0-2 share blocks 4-5 too (a nested node); each then
    has ``tails[i]`` private tokens."""
    rows, nxt = [], 6
    for i, t in enumerate(tails):
        r = [0, 1, 2, 3] + ([4, 5] if i < 3 else [])
        n_priv = -(-t // BS)
        rows.append(r + list(range(nxt, nxt + n_priv)))
        nxt += n_priv
    lens = [len(r) * BS - (-t % BS) for r, t in zip(rows, tails)]
    table = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    k, v = make_cache(nxt, BS, HKV, D, dtype, device)
    q = torch.randn(len(rows), HQ, D, device=device).to(dtype)
    return q, k, v, table, np.array(lens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 20, 40, 70, 100, 1000])
def test_cascade(device, dtype, window):
    """Windows inside the tails (every node dropped), crossing the nested node, crossing the root,
    and wider than every context (nothing trimmed)."""
    q, k, v, table, lens = _shared_inputs(device, dtype, [5, 20, 40, 3, 30, 60])
    cplan = pb.plan_cascade(table, lens, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                            device=device, cost=CascadeCost(0, 0, 0), window=window)
    bt, sl = torch.from_numpy(table).to(device), torch.from_numpy(lens.astype(np.int32)).to(device)
    out, lse = pb.cascade_decode(q, k, v, cplan, window=window)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, window=window), dtype)
    lo = np.maximum(lens - window, 0)
    for members, t0, t1 in cplan.nodes():  # a kept node is reached by a member, and starts at its window's block
        assert (lo[members] < t1).any() and t0 >= lo[members].min() // BS * BS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [20, 40, 70, 100])
def test_cascade_reads_no_block_below_a_members_window(device, window):
    """vLLM's Model Runner V2 replaces each row's table entries wholly below its window with its null
    block (freed, maybe reused): a node's keys are read through the member whose window starts first,
    so no read reaches such an entry (the other members mask the keys before their windows)."""
    q, k, v, table, lens = _shared_inputs(device, torch.float32, [5, 20, 40, 3, 30, 60])
    poison = k.shape[0]  # a block of NaN, where the kernels' table has the entries vLLM nulls
    k2, v2 = (torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (k, v))
    nulled = table.copy()
    nulled[np.arange(table.shape[1])[None, :] < (np.maximum(lens - window, 0) // BS)[:, None]] = poison
    cplan = pb.plan_cascade(table, lens, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                            device=device, cost=CascadeCost(0, 0, 0), window=window,
                            block_table_device=torch.from_numpy(nulled).to(device))
    assert not cplan.is_flat
    out, lse = pb.cascade_decode(q, k2, v2, cplan, window=window)
    bt, sl = torch.from_numpy(table).to(device), torch.from_numpy(lens.astype(np.int32)).to(device)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, window=window), torch.float32)


def test_cascade_plan_follows_the_window():
    """16 samples of an 8192-token prompt, 100 tokens each since, window 1024: the shared node is
    read from the samples' earliest window block on (once), the tails hold the rest."""
    table = np.zeros((16, 520), np.int32)
    table[:, :512] = np.arange(512)
    table[:, 512:519] = 512 + np.arange(16 * 7).reshape(16, 7)
    lens = np.full(16, 8192 + 100)
    cplan = pb.plan_cascade(table, lens, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                            device="cpu", window=1024)
    [(members, t0, t1)] = cplan.nodes()
    assert (t0, t1) == ((8192 + 100 - 1024) // BS * BS, 8192) and len(members) == 16
    assert cplan.unique_tokens() == (t1 - t0) + 16 * 100


def test_cascade_drops_a_parent_keeps_its_child():
    """The root node (blocks 0-3) lies wholly outside every window; the nested node (blocks 4-5)
    is reached by its members: it stays, one level up, and the result is exact."""
    q, k, v, table, lens = _shared_inputs("cpu", torch.float32, [16, 16, 16, 80, 80, 80])
    # requests 0-2: 112 tokens, windows from 72 (block 4); requests 3-5: 144 tokens, windows from 104
    cplan = pb.plan_cascade(table, lens, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                            device="cpu", cost=CascadeCost(0, 0, 0), window=40)
    nodes = cplan.nodes()
    assert [(list(m), t0, t1) for m, t0, t1 in nodes] == [([0, 1, 2], 64, 96)]
    assert list(cplan.node_level) == [0]
    bt, sl = torch.from_numpy(table), torch.from_numpy(lens.astype(np.int32))
    out, lse = pb.cascade_decode(q, k, v, cplan, window=40)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, window=40), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_forest_reuse(device):
    """A later step reuses a window plan's forest (untrimmed) and trims it for its own lengths."""
    q, k, v, table, lens = _shared_inputs(device, torch.float32, [5, 20, 40, 3, 30, 60])
    kw = dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, device=device, cost=CascadeCost(0, 0, 0))
    first = pb.plan_cascade(table, lens - 3, window=50, **kw)
    cplan = pb.plan_cascade(table, lens, window=50, forest=first, **kw)
    bt, sl = torch.from_numpy(table).to(device), torch.from_numpy(lens.astype(np.int32)).to(device)
    out, lse = pb.cascade_decode(q, k, v, cplan, window=50)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, window=50), torch.float32)
    with pytest.raises(ValueError, match="window"):
        pb.plan_cascade(table, lens, forest=first, **kw)  # planned with another window


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 7, 33, 100])
def test_prefill(device, dtype, window):
    """A fresh prompt, a chunk over a cached prefix, a decode row; windows shorter than a query
    tile and longer than some contexts."""
    lens, q_lens = [90, 150, 33, 64], [90, 47, 1, 64]
    k, v = make_cache(40, BS, HKV, D, dtype, device)
    bt = make_block_table(lens, BS, 40, device=device)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), HQ, D, device=device).to(dtype)
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl, window=window)
    ref = prefill_reference(q, k, v, bt, sl, qsl.cpu(), window=window)
    assert_close_state(out, lse, *ref, dtype)
    assert rel_err(ref[0], prefill_reference(q, k, v, bt, sl, qsl.cpu())[0]) > 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_with_softcap_and_sinks(device):
    lens = [70, 3, 200]
    q, k, v, bt, sl = make_decode_inputs(lens, HQ, HKV, D, BS, torch.float32, device, q_scale=4.0)
    kw = dict(softcap=5.0, sinks=torch.linspace(-2.0, 8.0, HQ, device=device), window=24)
    out, lse = pb.paged_decode(q, k, v, bt, sl, plan=_plan(lens, device, window=24), **kw)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, **kw), torch.float32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
    out, lse = pb.paged_prefill(q, k, v, bt, sl, qsl, **kw)
    assert_close_state(out, lse, *decode_reference(q, k, v, bt, sl, **kw), torch.float32)


@pytest.mark.parametrize("bad, err", [(0, ValueError), (-4, ValueError), (2.5, TypeError), ("8", TypeError),
                                      (True, TypeError)])
def test_bad_window(bad, err):
    q, k, v, bt, sl = make_decode_inputs([20], 4, 2, 64, 16, torch.float32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    for call in (lambda: pb.paged_decode(q, k, v, bt, sl, window=bad),
                 lambda: pb.paged_prefill(q, k, v, bt, sl, qsl, window=bad),
                 lambda: pb.plan_decode([20], window=bad, **shape),
                 lambda: pb.plan_cascade(bt.numpy(), sl.numpy(), window=bad, **shape)):
        with pytest.raises(err, match="window"):
            call()


def test_plan_window_must_match():
    q, k, v, bt, sl = make_decode_inputs([20], 4, 2, 64, 16, torch.float32)
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    plan = pb.plan_decode([20], window=8, **shape)
    for kw in ({}, {"window": 4}):
        with pytest.raises(ValueError, match="window"):
            pb.paged_decode(q, k, v, bt, sl, plan=plan, **kw)
    with pytest.raises(ValueError, match="window"):
        pb.paged_decode(q, k, v, bt, sl, plan=pb.plan_decode([20], **shape), window=8)
    cplan = pb.plan_cascade(bt.numpy(), sl.numpy(), window=8, **shape)
    with pytest.raises(ValueError, match="window"):
        pb.cascade_decode(q, k, v, cplan)
    with pytest.raises(ValueError, match="causal"):
        pb.paged_prefill(q, k, v, bt, sl, torch.tensor([0, 1], dtype=torch.int32), causal=False, window=8)
