"""The eager CUDA-graph path of TreeMerger (``paged_backend.parallel.merge_plans.MergeGraph``) and the
producer writing into the send buffer.

CPU (gloo) ranks use a stand-in graph whose ``replay()`` runs the plan's body eagerly: it checks
the logic around the graph (plain warm-up call, capture on the second call, agreement across ranks
- one failing rank turns the path off everywhere - staging, fresh results, off while the caller
captures). The gpu-marked tests capture real graphs with NCCL (one rank, and two ranks on 2 GPUs).
"""
from __future__ import annotations

import os

import pytest
import torch

import paged_backend as pb
from paged_backend.parallel import tree
from paged_backend.parallel.context import Placement, cp_decode, shard_paged_kv
from paged_backend.parallel.merge_plans import GatherPlan, MergeGraph
from paged_backend.parallel import TreeMerger, get_merger
from paged_inputs import make_decode_inputs
from reference import assert_close_state, decode_reference
from test_parallel import _Counting, _launch, _rank_states


class _EagerGraph(MergeGraph):
    """CPU stand-in for a captured graph: replay() runs the plan's body eagerly into the result."""

    def capture(self, plan, group):
        return lambda: plan.body(group, self.o, self.lse)


def _graphs_on(m, shape, dtype):
    """m's plans for this shape with the graph path switched on (CPU plans start with it off)."""
    cpu = torch.device("cpu")
    if len(m.levels) == 1:
        plans = [m.levels[0].plan(torch.Size(shape), dtype, dtype, cpu)]
    else:
        plans = [m.levels[0].plan(torch.Size(shape), dtype, torch.float32, cpu),
                 m.levels[1].plan(torch.Size(shape), torch.float32, dtype, cpu)]
    for p in plans:
        p.graph = None
    return plans


def _plus(n, **extra):
    return {k: v + extra.get(k, 0) for k, v in n.items()}


def _check_calls(m, plain, data, plans, want_plain, want_graph):
    """Merges ``data`` in turn with m and plain (graphs off): the same bits; the first call plain, the
    second captures (+1 all-reduce per level: the agreement), then replays; collectives as wanted;
    results never aliased."""
    held = []
    with _Counting() as c:
        for i, x in enumerate(data):
            got = m.merge(*x)
            n = c.take()
            ref = plain.merge(*x)
            c.take()
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), i
            want = want_plain if i == 0 else _plus(want_graph, all_reduce=len(plans)) if i == 1 else want_graph
            assert n == want, (i, n, want)
            assert all(isinstance(p.graph, _EagerGraph) == (i >= 1) for p in plans), i
            held.append((got, ref))
    for got, ref in held:  # a later call never overwrites what an earlier one returned
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert held[-1][0][0].data_ptr() != plans[-1].graph.result.data_ptr()


def _job_graph_logic(rank, world):
    os.environ["PAGED_BACKEND_DEBUG"] = "0"
    capturing = [False]
    fail_rank = [None]
    tree.try_capture = lambda plan, group: None if rank == fail_rank[0] else _EagerGraph(plan, group)
    torch.cuda.is_current_stream_capturing = lambda: capturing[0]
    o, lse, _, _, _, _ = _rank_states(rank, world, [3, 17, 40, 1], 4, 2, 16, 1.0, 7)
    data = [(o, lse), (o.flip(0).contiguous(), lse.flip(0).contiguous()), (o * 0.5, lse - 1.0), (o, lse)]
    per_call = {"allgather": dict(all_gather=1, all_reduce=0, cat=1),
                "allreduce": dict(all_gather=0, all_reduce=2, cat=0)}
    for strategy, want in per_call.items():
        m = TreeMerger(strategy=strategy)
        graph_want = want if strategy == "allgather" else _plus(want, cat=1)  # all-reduce: staged inputs
        _check_calls(m, TreeMerger(strategy=strategy, graphs=False), data, _graphs_on(m, o.shape, o.dtype), want,
                     graph_want)
    # a producer writing into the send views: no pack copy on the graph path either
    m = TreeMerger()
    [p] = _graphs_on(m, o.shape, o.dtype)
    plain = TreeMerger(graphs=False)
    views = m.send_views(o.shape, o.dtype, o.device)
    with _Counting() as c:
        for i, (xo, xl) in enumerate(data):
            views[0].copy_(xo)
            views[1].copy_(xl)
            c.take()
            got = m.merge(*views)
            assert c.take() == dict(all_gather=1, all_reduce=int(i == 1), cat=0), i
            ref = plain.merge(xo, xl)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert isinstance(p.graph, _EagerGraph)
    # one rank's capture fails: every rank keeps the plain path, no hang, same results
    fail_rank[0] = world - 1
    m = TreeMerger()
    plans = _graphs_on(m, o.shape, o.dtype)
    for x in data:
        got, ref = m.merge(*x), plain.merge(*x)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert plans[0].graph is False
    fail_rank[0] = None
    # the caller is capturing a graph: plain path, nothing warmed or captured
    capturing[0] = True
    m = TreeMerger()
    plans = _graphs_on(m, o.shape, o.dtype)
    for x in data:
        assert torch.equal(m.merge(*x)[0], plain.merge(*x)[0])
    assert plans[0].graph is None and not plans[0].warm
    capturing[0] = False
    if world == 4:  # hierarchical: the intra level's graph result is copied into the inter send buffer
        m = TreeMerger(strategy="allgather", hierarchy=2)
        want = dict(all_gather=2, all_reduce=0, cat=1)
        _check_calls(m, TreeMerger(strategy="allgather", hierarchy=2, graphs=False), data,
                     _graphs_on(m, o.shape, o.dtype), want, want)
    # cp_decode: the local decode writes into the send views; graphed merges stay exact
    torch.manual_seed(3)
    q, k, v, bt, sl = make_decode_inputs([5, 70, 33], 8, 2, 64, 16, torch.float32)
    ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
    k_l, v_l, bt_l, sl_l = shard_paged_kv(k, v, bt, sl, Placement(world, rank, 16))
    [p] = _graphs_on(get_merger(), q.shape, q.dtype)
    with _Counting() as c:
        for i in range(3):
            do, dl = cp_decode(q, k_l, v_l, bt_l, sl_l)
            assert c.take() == dict(all_gather=1, all_reduce=int(i == 1), cat=0), i
            assert_close_state(do, dl, ref_o, ref_lse, torch.float32)
    assert isinstance(p.graph, _EagerGraph)


@pytest.mark.kernel  # under TRITON_INTERPRET=1 the plans run the Triton merge kernels
@pytest.mark.parametrize("world", [2, 3, 4])
def test_graph_path_logic(world):
    _launch(_job_graph_logic, world)


def test_graphs_argument():
    with pytest.raises(TypeError, match="graphs"):
        TreeMerger(graphs="yes")


# ----------------------------------------------------------------------------------------------
# GPU: real captures with NCCL
def _job_gpu_one_rank(rank, world):
    """MergeGraph on a 1-rank NCCL group: replays match the plain path, results are fresh."""
    dev = torch.device("cuda", rank)
    o = torch.randn(8, 32, 128, device=dev).to(torch.bfloat16)
    lse = torch.randn(8, 32, device=dev) * 5
    p = GatherPlan(tuple(o.shape), o.dtype, o.dtype, dev, 1, True)
    want_o, want_lse = torch.empty_like(o), torch.empty_like(lse)
    p.run(o, lse, None, want_o, want_lse)  # warm-up: kernel compiled, communicator up
    g = MergeGraph(p, None)
    for x in ((o, lse), (o * 2, lse - 1), (-o, lse + 3)):
        p.stage(*x)
        g.replay()
        got = g.take()
        p.run(*x, None, want_o, want_lse)
        assert torch.equal(got[0], want_o) and torch.equal(got[1], want_lse)
        assert got[0].data_ptr() != g.result.data_ptr()


def _job_gpu_two_ranks(rank, world):
    """Eager TreeMerger calls replay graphs (captured on the second call) with the plain path's bits;
    cp_decode exact; a caller's own capture still works."""
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(rank)
    for strategy in ("allgather", "allreduce"):
        for b in (1, 8):
            m, plain = TreeMerger(strategy=strategy, graphs=True), TreeMerger(strategy=strategy, graphs=False)
            held = []
            for i in range(4):
                o = torch.randn(b, 32, 128, generator=g).to(dev, torch.bfloat16)
                lse = (torch.randn(b, 32, generator=g) * 5).to(dev)
                got, ref = m.merge(o, lse), plain.merge(o, lse)
                held.append((got, ref))
                [p] = m.levels[0].plans.values()
                assert isinstance(p.graph, MergeGraph) == (i >= 1), (strategy, b, i, p.graph)
            torch.cuda.synchronize()
            for got, ref in held:
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (strategy, b)
    # cp_decode through the cached merger: decode into the send buffer + graph replays
    torch.manual_seed(3)
    q, k, v, bt, sl = make_decode_inputs([5000, 17, 300, 1], 32, 8, 128, 16, torch.bfloat16)
    ref_o, ref_lse = decode_reference(q, k, v, bt, sl)
    k_l, v_l, bt_l, sl_l = (t.to(dev) for t in shard_paged_kv(k, v, bt, sl, Placement(world, rank, 16)))
    plan = pb.plan_decode(sl_l.cpu().numpy(), num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                          device=dev)
    for _ in range(3):
        o, lse = cp_decode(q.to(dev), k_l, v_l, bt_l, sl_l, plan=plan)
        assert_close_state(o.cpu(), lse.cpu(), ref_o, ref_lse, torch.bfloat16)
    [p] = get_merger().levels[0].plans.values()
    assert isinstance(p.graph, MergeGraph)
    # the caller captures its own graph around an already graphed shape: the plain path is captured
    m = TreeMerger(max_plans=None)
    o = torch.randn(2, 32, 128, generator=g).to(dev, torch.bfloat16)
    lse = torch.randn(2, 32, generator=g).to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            m.merge(o, lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, gl = m.merge(o, lse)
    o.mul_(-1)
    graph.replay()
    ref = TreeMerger(graphs=False).merge(o, lse)
    torch.cuda.synchronize()
    assert torch.equal(go, ref[0]) and torch.equal(gl, ref[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_merge_graph_one_rank():
    _launch(_job_gpu_one_rank, 1, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_eager_graphs_two_ranks():
    _launch(_job_gpu_two_ranks, 2, backend="nccl", timeout=300)
