"""tree_merge timings for bench_parallel.py: each strategy against one small all-reduce, and the
all-gather merge taken apart op by op.

Records (``bench`` is bench_parallel's ``Bench``; times in us, eager = events around one Python call
after a barrier and a sync, so host launch overhead counts; graph = one replay of the call captured
in a CUDA graph):

- ``merge`` (per B and strategy): ``tree_merge`` (``latency_us``), a held ``TreeMerger`` with its
  eager CUDA graphs on when the backend allows them (``merger_us``; ``internal_graph`` says whether
  its calls replay a graph) and off (``plain_us``), and the merger captured in a graph (``graph_us``).
- ``merge_ops`` (per B, the all-gather plan of one flat group): the bare all-gather of the packed
  message, the pack copy, the merge kernel and the full plain merge, each eager and in a graph; the
  eager call with its internal graph, with a pack copy (``internal_graph_us``) and with the state
  already in the send buffer as ``cp_decode`` leaves it (``internal_graph_no_pack_us``).
"""
from __future__ import annotations

import torch

from paged_backend.parallel import TreeMerger, pick_strategy, tree_merge


def tree_bytes(b, hq, d, esize, world, strategy) -> int:
    """Bytes one rank sends per tree_merge (ring-algorithm collectives, as NCCL runs them on one node)."""
    if world == 1:
        return 0
    msg = b * hq * (d * esize + 4)
    if strategy == "allgather":
        return (world - 1) * -(-msg // 16) * 16
    return 2 * (world - 1) * (b * hq * 4 + b * hq * (d + 1) * 4) // world


def _ratio(a, b):
    return a / b if a and b else None


def state(bench, b, hq, d):
    """A random rank-local state: o [b, hq, d] in the bench dtype, lse [b, hq] fp32."""
    o = torch.randn(b, hq, d, device=bench.dev, dtype=bench.dtype)
    return o, torch.randn(b, hq, device=bench.dev, dtype=torch.float32) * 5


def time_strategies(bench, b, hq, d, hier, small):
    """``merge`` records of batch b; ``small`` = the 4 KB all-reduce record."""
    o0, lse0 = state(bench, b, hq, d)
    esize = o0.element_size()
    for strat in ("auto", "allreduce", "allgather"):
        used = pick_strategy(o0, lse0, strat)
        t = bench.time_us(lambda: tree_merge(o0, lse0, strategy=strat, hierarchy=hier))
        # what an engine does: hold a TreeMerger, skip the checks (and capture the step in a graph)
        merger = TreeMerger(strategy=strat, hierarchy=hier, max_plans=None)
        plain = TreeMerger(strategy=strat, hierarchy=hier, max_plans=None, graphs=False)
        t_obj = bench.time_us(lambda: merger.merge(o0, lse0, check=False))
        t_plain = bench.time_us(lambda: plain.merge(o0, lse0, check=False))
        t_graph, err = bench.graph_us(lambda: plain.merge(o0, lse0, check=False))
        bench.record(kind="merge", world=bench.world, B=b, strategy=strat, used=used, latency_us=t,
                     merger_us=t_obj, plain_us=t_plain, graph_us=t_graph, graph_error=err,
                     internal_graph=all(bool(p.graph) for lvl in merger.levels for p in lvl.plans.values()),
                     gpu_ops_per_call=bench.gpu_ops_per_call(lambda: merger.merge(o0, lse0, check=False)),
                     vs_small_allreduce=t / small["latency_us"],
                     merger_vs_small_allreduce=t_obj / small["latency_us"],
                     graph_vs_small_allreduce_graph=_ratio(t_graph, small.get("graph_us")),
                     comm_bytes=tree_bytes(b, hq, d, esize, bench.world, used))


def time_ops(bench, b, hq, d, small):
    """The ``merge_ops`` record of batch b (flat world group, all-gather plan)."""
    if bench.world == 1:
        return
    o0, lse0 = state(bench, b, hq, d)
    plain = TreeMerger(strategy="allgather", max_plans=None, graphs=False)
    held = TreeMerger(strategy="allgather", max_plans=None)
    p = plain.levels[0].plan(o0.shape, o0.dtype, o0.dtype, o0.device)
    out, out_lse = torch.empty_like(o0), torch.empty_like(lse0)
    views = held.send_views(o0.shape, o0.dtype, o0.device)
    views[0].copy_(o0)
    views[1].copy_(lse0)
    rec = dict(kind="merge_ops", world=bench.world, B=b, msg_bytes=p.n, gathered_bytes=p.recv.numel())
    ops = {"allgather": lambda: p.gather(None), "pack": lambda: p.stage(o0, lse0),
           "kernel": lambda: p.merge_gathered(out, out_lse), "plain": lambda: plain.merge(o0, lse0, check=False)}
    for name, fn in ops.items():
        rec[f"{name}_us"] = bench.time_us(fn)
        rec[f"{name}_graph_us"], err = bench.graph_us(fn)
        if err:
            rec[f"{name}_graph_error"] = err
    rec["internal_graph_no_pack_us"] = bench.time_us(lambda: held.merge(*views, check=False))
    rec["internal_graph_us"] = bench.time_us(lambda: held.merge(o0, lse0, check=False))
    rec["internal_graph"] = bool(held.levels[0].plan(o0.shape, o0.dtype, o0.dtype, o0.device).graph)
    rec["internal_graph_vs_small_allreduce"] = rec["internal_graph_us"] / small["latency_us"]
    bench.record(**rec)


def summary_lines(records) -> list[str]:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = []
    for r in records:
        if r["kind"] == "merge":
            lines.append(f"merge B={r['B']} {r['strategy']:>9} ({r['used']}): tree_merge {r['latency_us']:.1f} us = "
                         f"{r['vs_small_allreduce']:.2f}x one 4 KB all-reduce; TreeMerger {fmt(r.get('merger_us'))}"
                         f" us ({'internal graph' if r.get('internal_graph') else 'plain'}; plain "
                         f"{fmt(r.get('plain_us'))}); CUDA graph {fmt(r.get('graph_us'))} us"
                         + (f" = {r['graph_vs_small_allreduce_graph']:.2f}x the graphed all-reduce"
                            if r.get("graph_vs_small_allreduce_graph") else "")
                         + (f" ({r['graph_error']})" if r.get("graph_error") else "")
                         + (f"; {r['gpu_ops_per_call']} GPU ops/call" if r.get("gpu_ops_per_call") else ""))
        elif r["kind"] == "merge_ops":
            pair = lambda k: f"{fmt(r.get(k + '_us'))} / {fmt(r.get(k + '_graph_us'))}"  # noqa: E731
            lines.append(f"merge ops B={r['B']} ({r['msg_bytes']} B per rank), us eager / graph: all-gather "
                         f"{pair('allgather')}, pack {pair('pack')}, merge kernel {pair('kernel')}, plain merge "
                         f"{pair('plain')}; eager with internal graph ({'on' if r['internal_graph'] else 'off'}) "
                         f"{fmt(r['internal_graph_us'])} (no pack {fmt(r['internal_graph_no_pack_us'])}) = "
                         f"{r['internal_graph_vs_small_allreduce']:.2f}x one 4 KB all-reduce")
    return lines
