"""Sequence-parallel decode: tree (cp_decode = local stream-K decode + tree_merge) vs ring vs one GPU.

    torchrun --nproc_per_node=4 benchmarks/bench_parallel.py --out benchmarks/results/parallel_h200x4.json

bf16, Hq 32, Hkv 8, D 128, page 16, pages shuffled; B = 1 and 8; contexts 128K, 512K, 1M (and 2M on
>= 4 GPUs). Per case: latency (median of CUDA-event times, barrier before each run, max over ranks),
bytes each rank sends per decode step (computed from the algorithm), peak memory
(``torch.cuda.max_memory_allocated`` reset per case; it includes the rank's KV shard). The one-GPU
baseline is rank 0 alone decoding the whole context with ``pb.paged_decode``. Also times
``tree_merge`` alone per strategy against one 4 KB all-reduce: the function, a held ``TreeMerger``
(no checks; with and without its eager CUDA graphs), and the merger captured in a CUDA graph (if
NCCL capture works; else the error is recorded), with the GPU operations per call from the profiler;
and the all-gather merge op by op (merge_timing.py). ``--merge-only`` stops there. On a machine
without CUDA it runs on gloo/CPU (a smoke test: pass small ``--contexts``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import paged_backend as pb  # noqa: E402
from paged_backend.parallel.context import (Placement, cp_decode, ring_bytes_per_step, ring_decode,  # noqa: E402
                                            shard_paged_kv)
from paged_backend.parallel import make_hierarchy, pick_strategy  # noqa: E402
from merge_timing import summary_lines, time_ops, time_strategies, tree_bytes  # noqa: E402

K = 1024


def parse_ctx(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": K, "M": K * K}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KM" else s) * mult)


class Bench:
    def __init__(self, args):
        self.args = args
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if self.cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.records = []

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_us(self, fn, collective=True) -> float:
        """Median microseconds of ``fn`` (barrier before each run), max over ranks when collective."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        est = time.perf_counter() - t0
        iters = max(3, min(self.args.iters, int(self.args.budget_s / max(est, 1e-6))))
        times = []
        for _ in range(iters):
            if collective:
                dist.barrier()
            self.sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=self.dev)
        if collective:
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return float(med)

    @staticmethod
    def capture(fn):
        """-> (CUDA graph of one call of fn, None), or (None, error). Warmed up off the capture stream."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture stream (plans, buffers, Triton)
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
            return graph, None
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]

    def graph_us(self, fn):
        """``(median us of replaying fn captured in a CUDA graph, None)``, or ``(None, error)`` when the
        capture fails on any rank (NCCL collectives can be captured on recent torch/NCCL; an engine
        captures its decode step, so this is the merge cost it would see)."""
        if not self.cuda:
            return None, "no CUDA"
        graph, err = self.capture(fn)
        ok = torch.tensor([0 if err else 1], dtype=torch.int32, device=self.dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # replay only if every rank captured (else peers hang)
        if not int(ok):
            return None, err or "capture failed on another rank"
        return self.time_us(graph.replay), None

    def gpu_ops_per_call(self, fn):
        """GPU activities (kernels, incl. NCCL's, and memcpy/memset) of one call, from the profiler."""
        if not self.cuda:
            return None
        try:
            from torch.profiler import ProfilerActivity, profile
            fn()
            self.sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                self.sync()
            return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        except Exception:  # noqa: BLE001
            return None

    def reset_peak(self):
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        if not self.cuda:
            return 0
        p = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.int64, device=self.dev)
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
        return int(p)

    def record(self, **kw):
        self.records.append(kw)
        if self.rank == 0:
            print(json.dumps(kw), flush=True)

    def paged(self, b, cols, tokens, hq, hkv, d, bs):
        """b requests of ``tokens`` each over ``cols`` shuffled pages apiece (random data), and their plan."""
        nb = b * cols
        k = torch.randn(nb, bs, hkv, d, device=self.dev, dtype=self.dtype)
        v = torch.randn(nb, bs, hkv, d, device=self.dev, dtype=self.dtype)
        bt = torch.randperm(nb, device=self.dev).to(torch.int32).view(b, cols)
        sl = torch.full((b,), tokens, dtype=torch.int32, device=self.dev)
        plan = pb.plan_decode([tokens] * b, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                              device=self.dev)
        return k, v, bt, sl, plan

    def make_shard(self, b, ctx, hq, hkv, d, bs):
        """This rank's round-robin shard of b requests of ctx tokens."""
        n_local = int(Placement(self.world, self.rank, bs).local_lens(ctx))
        blocks = -(-ctx // bs)
        cols = -(-blocks // self.world)  # the most any rank holds: equal shapes everywhere (ring needs them)
        return self.paged(b, cols, n_local, hq, hkv, d, bs)

    def query(self, b, hq, d):
        q = torch.randn(b, hq, d, device=self.dev, dtype=self.dtype)
        dist.broadcast(q, 0)
        return q

    def check(self, hq, hkv, d, bs):
        """Small correctness check: cp_decode and ring_decode against paged_decode of the whole KV."""
        torch.manual_seed(1234)
        lens = [4096 + 37, 1000, 1]
        nblk = sum(-(-n // bs) for n in lens)
        k = torch.randn(nblk, bs, hkv, d, device=self.dev).to(self.dtype)
        v = torch.randn(nblk, bs, hkv, d, device=self.dev).to(self.dtype)
        cols = max(-(-n // bs) for n in lens)
        bt = torch.zeros(len(lens), cols, dtype=torch.int32)
        perm, at = torch.randperm(nblk), 0
        for i, n in enumerate(lens):
            bt[i, :-(-n // bs)] = perm[at:at - (-n // bs)].to(torch.int32)
            at += -(-n // bs)
        bt, sl = bt.to(self.dev), torch.tensor(lens, dtype=torch.int32, device=self.dev)
        q = torch.randn(len(lens), hq, d, device=self.dev).to(self.dtype)
        ref_o, ref_lse = pb.paged_decode(q, k, v, bt, sl)
        pl = Placement(self.world, self.rank, bs)
        kl, vl, btl, sll = shard_paged_kv(k, v, bt, sl, pl, num_blocks=-(-nblk // self.world) + len(lens))
        out = {}
        for name, fn in (("tree", cp_decode), ("ring", ring_decode)):
            o, lse = fn(q, kl, vl, btl, sll)
            err = ((o.float() - ref_o.float()).norm() / ref_o.float().norm()).item()
            dl = (lse - ref_lse).abs().max().item()
            out[name] = (err, dl)
            if err > 1e-2 or dl > 1e-2:
                raise SystemExit(f"rank {self.rank}: {name} check failed: rel err {err:.3g}, lse err {dl:.3g}")
        self.record(kind="check", world=self.world, tree_rel_err=out["tree"][0], ring_rel_err=out["ring"][0])

    def run(self):
        a = self.args
        hq, hkv, d, bs = a.hq, a.hkv, a.head_dim, a.page
        esize = torch.tensor([], dtype=self.dtype).element_size()
        contexts = [parse_ctx(c) for c in a.contexts.split(",")] if a.contexts else \
            [128 * K, 512 * K, K * K] + ([2 * K * K] if self.world >= 4 else [])
        batches = [int(x) for x in a.batches.split(",")]
        hier = make_hierarchy(a.ranks_per_node) if a.ranks_per_node else None
        if not a.no_check:
            self.check(hq, hkv, d, bs)
        # one small all-reduce: the unit the merge overhead is compared with
        buf = torch.ones(1024, dtype=torch.float32, device=self.dev)
        t_small = self.time_us(lambda: dist.all_reduce(buf))
        t_small_graph, err = self.graph_us(lambda: dist.all_reduce(buf))
        self.record(kind="allreduce_4KB", world=self.world, latency_us=t_small, graph_us=t_small_graph,
                    graph_error=err)
        small = self.records[-1]
        for b in batches:
            time_strategies(self, b, hq, d, hier, small)
            time_ops(self, b, hq, d, small)
        if a.merge_only:
            return self.records
        for b in batches:
            q = self.query(b, hq, d)
            for ctx in contexts:
                self.case(b, ctx, q, hq, hkv, d, bs, esize, hier)
        return self.records

    def case(self, b, ctx, q, hq, hkv, d, bs, esize, hier):
        a = self.args
        base = dict(world=self.world, B=b, ctx=ctx)
        res = {}
        if not a.skip_single:  # rank 0 alone decodes the whole context; the others wait
            self.reset_peak()
            rec = dict(base, kind="single")
            if self.rank == 0:
                try:
                    k, v, bt, sl, plan = self.paged(b, -(-ctx // bs), ctx, hq, hkv, d, bs)
                    one = lambda: pb.paged_decode(q, k, v, bt, sl, plan=plan)  # noqa: E731
                    rec["latency_us"] = self.time_us(one, collective=False)
                    if self.cuda:
                        graph, err = self.capture(one)
                        rec["graph_us"] = self.time_us(graph.replay, collective=False) if graph else None
                    rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else 0
                    del k, v, bt, sl, plan
                except torch.cuda.OutOfMemoryError as e:
                    rec["error"] = f"OOM: {str(e).splitlines()[0]}"
            dist.barrier()
            info = [None] * self.world
            dist.all_gather_object(info, rec)
            res["single"] = info[0]
            self.record(**info[0])
        self.reset_peak()
        k, v, bt, sl, plan = self.make_shard(b, ctx, hq, hkv, d, bs)
        kv_bytes = 2 * k.numel() * esize
        t_local = self.time_us(lambda: pb.paged_decode(q, k, v, bt, sl, plan=plan))
        self.record(**base, kind="local_decode", latency_us=t_local, shard_kv_bytes=kv_bytes)
        o_probe = torch.empty(b, hq, d, dtype=self.dtype, device=self.dev)
        lse_probe = torch.empty(b, hq, dtype=torch.float32, device=self.dev)
        for strat in ("auto",) + (("allreduce", "allgather") if a.all_strategies else ()):
            self.reset_peak()
            t = self.time_us(lambda: cp_decode(q, k, v, bt, sl, plan=plan, strategy=strat, hierarchy=hier))
            used = pick_strategy(o_probe, lse_probe, strat)
            res[f"tree_{strat}"] = dict(base, kind="tree", strategy=strat, used=used, latency_us=t,
                                        merge_us=t - t_local, peak_mem_bytes=self.peak(),
                                        comm_bytes=tree_bytes(b, hq, d, esize, self.world, used))
            if strat == "auto" and self.cuda:
                gus, err = self.graph_us(lambda: cp_decode(q, k, v, bt, sl, plan=plan, hierarchy=hier))
                res["tree_auto"]["graph_us"] = gus
                if err:
                    res["tree_auto"]["graph_error"] = err
            self.record(**res[f"tree_{strat}"])
        if not a.skip_ring:
            self.reset_peak()
            try:
                t = self.time_us(lambda: ring_decode(q, k, v, bt, sl))
                res["ring"] = dict(base, kind="ring", latency_us=t, peak_mem_bytes=self.peak(),
                                   comm_bytes=(self.world - 1) * ring_bytes_per_step(k, bt))
            except torch.cuda.OutOfMemoryError as e:
                res["ring"] = dict(base, kind="ring", error=f"OOM: {str(e).splitlines()[0]}")
            self.record(**res["ring"])
        del k, v, bt, sl, plan
        tree = res["tree_auto"]
        ratios = dict(base, kind="ratios")
        if res.get("single", {}).get("latency_us"):
            ratios["single_over_tree"] = res["single"]["latency_us"] / tree["latency_us"]
        if res.get("single", {}).get("graph_us") and tree.get("graph_us"):
            ratios["single_over_tree_graph"] = res["single"]["graph_us"] / tree["graph_us"]
        if res.get("ring", {}).get("latency_us"):
            ratios["ring_over_tree"] = res["ring"]["latency_us"] / tree["latency_us"]
            if res["ring"]["peak_mem_bytes"]:
                ratios["tree_peak_over_ring"] = tree["peak_mem_bytes"] / res["ring"]["peak_mem_bytes"]
        self.record(**ratios)


def summary(records, world) -> str:
    by = {}
    for r in records:
        if "B" in r and "ctx" in r:
            by.setdefault((r["B"], r["ctx"]), {})[r["kind"] + ("_" + r["strategy"] if r["kind"] == "tree" else "")] = r
    lines = [f"world {world}: latency us (peak GiB, bytes sent per rank per step)",
             f"{'B':>3} {'ctx':>8} | {'one GPU':>20} | {'tree':>26} | {'ring':>28} | {'1GPU/tree':>9} "
             f"{'ring/tree':>9} {'mem t/r':>7} | {'graphs: 1GPU':>12} {'tree':>7} {'1GPU/tree':>9}"]
    gib = 1024 ** 3

    def cell(r, w):
        if not r:
            return f"{'-':>{w}}"
        if "error" in r:
            return f"{r['error'][:w]:>{w}}"
        s = f"{r['latency_us']:.0f} ({r.get('peak_mem_bytes', 0) / gib:.1f}G"
        s += f", {r['comm_bytes']:.3g}B)" if "comm_bytes" in r else ")"
        return f"{s:>{w}}"

    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for (b, ctx), c in sorted(by.items()):
        rt = c.get("ratios", {})
        f = lambda key: f"{rt[key]:.2f}" if key in rt else "-"  # noqa: E731
        lines.append(f"{b:>3} {ctx // K:>7}K | {cell(c.get('single'), 20)} | {cell(c.get('tree_auto'), 26)} | "
                     f"{cell(c.get('ring'), 28)} | {f('single_over_tree'):>9} {f('ring_over_tree'):>9} "
                     f"{f('tree_peak_over_ring'):>7} | {fmt(c.get('single', {}).get('graph_us')):>12} "
                     f"{fmt(c.get('tree_auto', {}).get('graph_us')):>7} {f('single_over_tree_graph'):>9}")
    small = [r for r in records if r["kind"] == "allreduce_4KB"]
    if small:
        lines.append(f"one 4 KB all-reduce: {small[0]['latency_us']:.1f} us eager, "
                     f"{fmt(small[0].get('graph_us'))} us in a CUDA graph")
    lines += summary_lines(records)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON results path (rank 0 writes it)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default=None, help="comma list, e.g. 128K,512K,1M,2M")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=2.0, help="time budget per measurement")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="hierarchical merge with nodes of this size")
    ap.add_argument("--all-strategies", action="store_true", help="also time cp_decode with each strategy")
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-ring", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--merge-only", action="store_true", help="only the 4 KB all-reduce and the merge timings")
    args = ap.parse_args()
    bench = Bench(args)
    records = bench.run()
    dist.barrier()
    if bench.rank == 0:
        info = dict(world=bench.world, device=torch.cuda.get_device_name() if bench.cuda else "cpu",
                    torch=torch.__version__, env={k: os.environ.get(k) for k in
                                                  ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
                    args=vars(args), records=records)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(info, f, indent=1)
        print(summary(records, bench.world), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
