"""Issue 36 item 5: eager stream-K decode of one short request measured 2x slower than split (H200,
B1x8K: ``ours_sk`` 50.8 us eager, 16.6 us in a CUDA graph; ``ours_split`` 23.1 us eager). Is it host
work, launch work or GPU work, and does it depend on the plan or on the measurement?

    python3 benchmarks/decode_eager_check.py [--cases B1x8K,B64x4K] [--no-profile] [--trace DIR]

(repo root as cwd; ~30-80 s on an H200, most of it compiling on a cold Triton cache.) For B1x8K,
B1x32K, B4x8K, B64x4K (bf16, Hq 32, Hkv 8, D 128, page 16, pages shuffled, input sets rotated past
the L2 as benchmarks/bench_decode.py does), the default plan (``sk``: mode stream_k) against the
split plan (``split``), both through ``pb.paged_decode(..., plan=plan)`` as bench_decode times them:

  graph     do_bench of one CUDA graph holding >= 10 calls (input sets cycled), per call: GPU time
  eager1/2  triton.testing.do_bench of eager calls (an L2 flush by a 256 MB memset before each timed
            call: bench_decode's eager cell until 2026-11-29, common.flush_l2's read since), two rounds
            in the order sk, split, sk, split (B1x8K sk first in the process): a gap that is not the
            same in both rounds is the measurement
  eager_pre do_bench's timed loop with its timing events made and recorded before the loop
  host      perf_counter around the submission of 1000 eager calls, 10 chunks of 100 with a sync
            between chunks (the launch queue never fills): host time per call
  loop      perf_counter around 1000 calls without sync, divided (the queue may fill: then GPU-bound)
  wall      the same 1000 calls up to a final synchronize, per call: max(host, GPU) back to back
  nolaunch  host time per call with the compiled kernels' driver launches replaced by no-ops
            (host - nolaunch = the driver's launch calls)
  path      per call: direct relaunches (DecodePlan.launches) / launch() calls (the keyed direct
            path or the normal one) / JITFunction.run calls (Triton's normal path)
  allocs    per call: caching-allocator allocations (out and lse: 2 expected) and cudaMalloc segments
  sync      whether a call synchronizes with the device (torch.cuda.set_sync_debug_mode("error"))
  kernels   torch.profiler: kernels per call, names and mean GPU us; CUDA API calls per call
            (cudaLaunchKernel / cuLaunchKernelEx / ...) with mean host us

The eager cell includes host time only when the host needs longer from do_bench's flush memset to
the call's last launch than the memset runs (``flush`` below): the line "eager is host-bound if
host + flush_host > flush_gpu" says where that threshold is on this machine. The cell also counts
the host time of ``end_event.record()`` whenever the GPU is done before it: do_bench makes two new
timing events per timed call, and a new event is created at its first record (a driver call that
took ~45 us on an H100 host, paged_backend/decode_plan.py). bench_decode times ``ours_sk`` first in each
case's fresh process, so if that creation is slow until the driver has events to reuse, the first
do_bench of a process (ours_sk's eager cell) pays it and the later ones (ours_split, FlashInfer, the
graph cells) do not. Hence: B1x8K sk is this process's first do_bench, as in bench_decode, and
two fresh child processes measure (a) B1x8K eager in the order split, sk, split, sk and (b) the
host cost of a timing event's first record, cold and after 200 events were destroyed. Then a B1x8K
A/B with PAGED_BACKEND_PDL=0 (programmatic dependent launch off), time permitting. Prints tables;
exits 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

import common as C  # noqa: E402
import paged_backend as pb  # noqa: E402
from paged_backend.kernels import decode as KD  # noqa: E402
from paged_backend.kernels import launch as KL  # noqa: E402

K = 1024
CASES = {"B1x8K": [8 * K], "B1x32K": [32 * K], "B4x8K": [8 * K] * 4, "B64x4K": [4 * K] * 64}
HQ, HKV, D, BS = 32, 8, 128, 16
PLANS = ("sk", "split")
MODE = {"sk": "stream_k", "split": "split"}
BUDGET_S = 70.0  # optional parts are skipped past this (the whole run stays under 90 s)
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():5.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- inputs and calls
def make_inputs(lens, seed=0):
    """(block table, lengths, input sets) as bench_decode makes them (pages shuffled, sets rotated past the L2)."""
    inp = C.make_paged_inputs(lens, HQ, HKV, D, BS, torch.bfloat16, "cuda", seed=seed)
    return inp.block_table, inp.seq_lens, inp.sets


def make_plan(lens, mode):
    return pb.plan_decode(np.asarray(lens), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                          device="cuda", mode=mode)


def make_fns(bt, sl, sets, plan):
    return [lambda q=q, k=k, v=v: pb.paged_decode(q, k, v, bt, sl, plan=plan) for q, k, v in sets]


# ----------------------------------------------------------------------------- timings
def bench_us(fn, warmup=10, rep=60) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def bench_pre_us(fn, n=400) -> float:
    """do_bench's timed loop (L2 flush, start event, call, end event) with timing events made and
    recorded once before the loop: no event is created inside it. Median us."""
    drv = triton.runtime.driver.active
    cache = drv.get_empty_cache_for_benchmark()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for e in starts + ends:
        e.record()
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        drv.clear_cache(cache)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def host_us(fn, calls=1000, chunk=100) -> dict:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    tot = 0.0
    for _ in range(calls // chunk):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        tot += time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"host": tot / calls * 1e6, "loop": (t1 - t0) / calls * 1e6, "wall": (t2 - t0) / calls * 1e6}


def flush_costs() -> dict:
    """do_bench's L2 flush: its GPU time, and the host time of one timed iteration without the call
    (flush + two event records)."""
    drv = triton.runtime.driver.active
    cache = drv.get_empty_cache_for_benchmark()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
    for _ in range(5):
        drv.clear_cache(cache)
    torch.cuda.synchronize()
    for a, b in evs:
        a.record()
        drv.clear_cache(cache)
        b.record()
    torch.cuda.synchronize()
    gpu = statistics.median(a.elapsed_time(b) for a, b in evs) * 1e3
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(200)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(200)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s, e in zip(starts, ends):
        drv.clear_cache(cache)
        s.record()
        e.record()
    host = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    del cache
    return {"flush_gpu": gpu, "flush_host": host}


# ----------------------------------------------------------------------------- what a call does
class Counting:
    """Counts, while active, relaunches (Relaunch.__call__), launch() calls from kernels/decode.py and
    JITFunction.run calls of the decode and fold kernels."""

    def __init__(self):
        self.n = Counter()

    def __enter__(self):
        n = self.n
        self.launch, self.call = KD.launch, KL.Relaunch.__call__
        orig_launch, orig_call = self.launch, self.call

        def launch(fn, grid, *a, **kw):
            n["launch()"] += 1
            return orig_launch(fn, grid, *a, **kw)

        def call(r, stream, *lead):
            n["relaunch"] += 1
            return orig_call(r, stream, *lead)

        KD.launch, KL.Relaunch.__call__ = launch, call
        for kern in (KD._decode_kernel, KD._fold_states_kernel):
            orig = kern.run

            def run(*a, _orig=orig, **kw):
                n["JITFunction.run"] += 1
                return _orig(*a, **kw)

            kern.run = run
        return self

    def __exit__(self, *exc):
        KD.launch, KL.Relaunch.__call__ = self.launch, self.call
        for kern in (KD._decode_kernel, KD._fold_states_kernel):
            del kern.run  # the instance attribute: JITFunction.run again


def call_path(fn, calls=50) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with Counting() as c:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    res = {k: c.n[k] / calls for k in ("relaunch", "launch()", "JITFunction.run")}
    res["allocs"] = (stats1.get("allocation.all.allocated", 0) - stats0.get("allocation.all.allocated", 0)) / calls
    res["segments"] = (stats1.get("segment.all.allocated", 0) - stats0.get("segment.all.allocated", 0)) / calls
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(3):
            fn()
        res["sync"] = "no"
    except Exception as e:  # a synchronizing torch op in the call
        res["sync"] = f"YES: {str(e).splitlines()[0][:80]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return res


def launchers():
    """The compiled decode and fold kernels' CudaLaunchers (the objects relaunches call)."""
    out = []
    for fn in (KD._decode_kernel, KD._fold_states_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in cache[0].values():
                r = compiled.run
                if hasattr(r, "launch"):
                    out.append(r)
    return out


def nolaunch_host_us(fn, calls=1000) -> float | None:
    rs = launchers()
    if not rs:
        return None
    saved = [r.launch for r in rs]
    try:
        for r in rs:
            r.launch = lambda *a: None
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        for r, s in zip(rs, saved):
            r.launch = s
        torch.cuda.synchronize()


def short(name: str) -> str:
    for key in ("_decode_kernel", "_fold_states_kernel"):
        if key in name:
            return key.strip("_").replace("_kernel", "")
    return name if len(name) <= 40 else name[:37] + "..."


def profile_calls(fn, calls=30, trace=None) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kern, api, ops = defaultdict(list), defaultdict(list), Counter()
    for e in prof.events():
        dur = e.time_range.elapsed_us()
        if e.device_type == DeviceType.CUDA:
            kern[short(e.name)].append(dur)
        elif e.name.startswith("cuda") or (e.name.startswith("cu") and e.name[2:3].isupper()):
            api[e.name].append(dur)
        elif e.name.startswith("aten::"):
            ops[e.name] += 1
    fmt = lambda d: ", ".join(f"{k} x{len(v) / calls:.2g} {statistics.mean(v):.1f}us"  # noqa: E731
                              for k, v in sorted(d.items(), key=lambda kv: -len(kv[1])))
    launches = sum(len(v) for k, v in api.items() if "Launch" in k) / calls
    return {"kernels/call": sum(len(v) for v in kern.values()) / calls, "launch_api/call": launches,
            "kernels": fmt(kern), "api": fmt(api),
            "aten": ", ".join(f"{k} x{v / calls:.2g}" for k, v in ops.most_common(6))}


# ----------------------------------------------------------------------------- main
def plan_note(plan) -> str:
    tile = plan.kernel_tile
    return f"G={plan.num_programs} P={plan.num_pieces}{' whole' if plan.whole else ''} tile={tile[0]}x{tile[1]}"


def run_case(name, lens, args) -> dict:
    bt, sl, sets = make_inputs(lens, seed=sum(map(ord, name)))
    plans = {p: make_plan(lens, MODE[p]) for p in PLANS}
    fns = {p: make_fns(bt, sl, sets, plans[p]) for p in PLANS}
    rot = {p: C.rotate(fns[p]) for p in PLANS}
    rec = {p: {"plan": plan_note(plans[p])} for p in PLANS}
    outs = {}
    for p in PLANS:  # first calls: compile and bind
        o, lse = fns[p][0]()
        torch.cuda.synchronize()
        outs[p] = (o.float(), lse)
    d_o = (outs["sk"][0] - outs["split"][0]).abs().max().item()
    d_l = (outs["sk"][1] - outs["split"][1]).abs().max().item()
    log(f"{name}: {len(sets)} input set(s); sk vs split max|do|={d_o:.2e} max|dlse|={d_l:.2e}; "
        f"sk {rec['sk']['plan']}; split {rec['split']['plan']}")
    for rnd in (1, 2):  # bench_decode's order (sk first), twice
        for p in PLANS:
            rec[p][f"eager{rnd}"] = bench_us(rot[p])
    for p in PLANS:
        rec[p]["eager_pre"] = bench_pre_us(rot[p])
    for p in PLANS:
        try:
            rec[p]["graph"] = C.graph_time_us(fns[p])
        except Exception as e:
            rec[p]["graph_error"] = str(e)[:100]
    for p in PLANS:
        rec[p].update(host_us(rot[p]))
        rec[p].update(call_path(rot[p]))
        rec[p]["nolaunch"] = nolaunch_host_us(rot[p])
    if not args.no_profile and elapsed() < BUDGET_S - 10:
        for p in PLANS:
            try:
                trace = os.path.join(args.trace, f"{name}_{p}.json") if args.trace else None
                rec[p].update(profile_calls(rot[p], trace=trace))
            except Exception as e:
                rec[p]["profile_error"] = str(e)[:120]
    del outs, fns, rot, plans, sets
    torch.cuda.empty_cache()
    return rec


def pdl_ab(args) -> dict:
    """B1x8K eager and graph with PAGED_BACKEND_PDL=0 (read per call by dispatch.use_pdl)."""
    lens = CASES["B1x8K"]
    bt, sl, sets = make_inputs(lens, seed=1)
    old = os.environ.get("PAGED_BACKEND_PDL")
    res = {}
    try:
        for pdl in ("1", "0"):
            os.environ["PAGED_BACKEND_PDL"] = pdl
            for p in PLANS:
                fns = make_fns(bt, sl, sets, make_plan(lens, MODE[p]))
                fns[0]()
                torch.cuda.synchronize()
                res[(pdl, p)] = (bench_us(C.rotate(fns)), C.graph_time_us(fns), host_us(C.rotate(fns), calls=500)["host"])
    finally:
        if old is None:
            os.environ.pop("PAGED_BACKEND_PDL", None)
        else:
            os.environ["PAGED_BACKEND_PDL"] = old
    return res


def child(kind: str) -> dict:
    """Runs in a fresh process (a new CUDA context, no timing event made yet)."""
    if kind == "order":  # B1x8K eager do_bench in the order split, sk, split, sk
        lens = CASES["B1x8K"]
        bt, sl, sets = make_inputs(lens, seed=sum(map(ord, "B1x8K")))
        fns = {p: make_fns(bt, sl, sets, make_plan(lens, MODE[p])) for p in PLANS}
        for p in PLANS:
            fns[p][0]()
        torch.cuda.synchronize()
        return {"order": [(p, bench_us(C.rotate(fns[p]))) for p in ("split", "sk", "split", "sk")]}
    # events: host cost of a timing event's first record (do_bench makes 2 new ones per timed call)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()

    def first_records(n=200):
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ts = []
        for e in evs:
            t0 = time.perf_counter()
            e.record()
            ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return evs, statistics.median(ts) * 1e6, max(ts) * 1e6

    evs, cold, cold_max = first_records()
    ts = []
    for e in evs:
        t0 = time.perf_counter()
        e.record()
        ts.append(time.perf_counter() - t0)
    again = statistics.median(ts) * 1e6
    del evs, e
    torch.cuda.synchronize()
    _, after, after_max = first_records()
    return {"first_record_cold": cold, "first_record_cold_max": cold_max, "record_again": again,
            "first_record_after_destroy": after, "first_record_after_destroy_max": after_max}


def run_child(kind: str, timeout: float) -> dict:
    import json
    import subprocess
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("CHILD "):
            return json.loads(line[6:])
    raise RuntimeError(f"child {kind} exit {done.returncode}: {(done.stderr or done.stdout)[-600:]}")


def fmt(v, nd=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-pdl-ab", action="store_true")
    ap.add_argument("--trace", help="directory for the profiler's chrome traces")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    if args.child:
        import json
        print("CHILD " + json.dumps(child(args.child)), flush=True)
        return 0
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    dev = torch.cuda.get_device_properties(0)
    from paged_backend.kernels.dispatch import use_pdl
    knobs = getattr(triton, "knobs", None)
    print(f"{dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}, Triton {triton.__version__}; "
          f"direct launch: {KL.DISABLED_BY or 'on'}; use_pdl: {use_pdl(torch.device('cuda', torch.cuda.current_device()))}; "
          f"Triton launch-enter hooks: {knobs and getattr(knobs.runtime.launch_enter_hook, 'calls', None)!r} "
          f"(any set: every launch takes Triton's normal path)", flush=True)
    results = {}
    for name in args.cases.split(","):
        if elapsed() > BUDGET_S:
            log(f"{name}: skipped (time budget)")
            continue
        try:
            results[name] = run_case(name, CASES[name], args)
        except Exception:
            log(f"{name}: failed")
            traceback.print_exc(limit=-4)
            torch.cuda.synchronize()
    flush = {"flush_gpu": float("nan"), "flush_host": float("nan")}
    try:
        flush = flush_costs()  # (after the cases: the first do_bench of the process is B1x8K sk's, as in bench_decode)
    except Exception:
        traceback.print_exc(limit=-2)
    print(f"\ndo_bench flush: GPU {flush['flush_gpu']:.1f} us, host (flush + 2 event records, events re-used here) "
          f"{flush['flush_host']:.1f} us -> eager is host-bound if host + {flush['flush_host']:.1f} > "
          f"{flush['flush_gpu']:.1f} us", flush=True)
    for rec in results.values():
        for p in PLANS:
            rec[p]["host_bound"] = rec[p]["host"] + flush["flush_host"] > flush["flush_gpu"]
    cols = ["plan", "graph", "eager1", "eager2", "eager_pre", "host", "nolaunch", "loop", "wall", "relaunch", "launch()",
            "JITFunction.run", "allocs", "segments", "sync", "kernels/call", "launch_api/call", "host_bound"]
    rows = [["case", "path"] + cols]
    for name, rec in results.items():
        for p in PLANS:
            rows.append([name, p] + [fmt(rec[p].get(c), 2 if c in ("relaunch", "launch()", "JITFunction.run",
                                                                    "allocs", "segments", "kernels/call",
                                                                    "launch_api/call") else 1) for c in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\nus per call (graph/eager: GPU events; host/nolaunch/loop/wall: perf_counter); path/allocs per call")
    for i, r in enumerate(rows):
        print(" | ".join(x.ljust(w) if j < 3 else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    print("\nsk / split (>1: the default plan is slower):")
    for name, rec in results.items():
        s, t = rec["sk"], rec["split"]
        ratio = lambda c: f"{s[c] / t[c]:.3f}" if s.get(c) and t.get(c) else "-"  # noqa: E731
        print(f"  {name:7s} graph {ratio('graph')}  eager1 {ratio('eager1')}  eager2 {ratio('eager2')}  "
              f"eager_pre {ratio('eager_pre')}  "
              f"host {ratio('host')}  wall {ratio('wall')}")
    print("\nprofile per call (torch.profiler; kernels: GPU us, API: host us):")
    for name, rec in results.items():
        for p in PLANS:
            r = rec[p]
            if "kernels" in r:
                print(f"  {name} {p}: kernels [{r['kernels']}]\n      API [{r['api']}]\n      aten [{r['aten']}]")
            elif "profile_error" in r:
                print(f"  {name} {p}: profile failed: {r['profile_error']}")
    for kind in ("order", "events"):
        if elapsed() > BUDGET_S - 12:
            print(f"\nchild '{kind}': skipped (time budget)")
            continue
        try:
            res = run_child(kind, timeout=max(10.0, BUDGET_S + 8 - elapsed()))
            if kind == "order":
                print("\nfresh process, B1x8K eager do_bench in the order split, sk, split, sk (us): "
                      + ", ".join(f"{p} {us:.1f}" for p, us in res["order"]))
            else:
                print("fresh process, a timing event's record, host us (median / max of 200): first record "
                      f"{res['first_record_cold']:.1f} / {res['first_record_cold_max']:.1f}; again "
                      f"{res['record_again']:.1f}; first record of new events after 200 were destroyed "
                      f"{res['first_record_after_destroy']:.1f} / {res['first_record_after_destroy_max']:.1f}")
        except Exception as e:
            print(f"\nchild '{kind}' failed: {str(e)[:300]}")
    if not args.no_pdl_ab and "B1x8K" in args.cases.split(",") and elapsed() < BUDGET_S - 12:
        try:
            res = pdl_ab(args)
            print("\nB1x8K with PDL on (1) / off (0): eager do_bench / graph / host us per call")
            for (pdl, p), (e, g, h) in res.items():
                print(f"  PDL={pdl} {p:5s}  eager {e:6.1f}  graph {g:6.1f}  host {h:6.1f}")
        except Exception:
            traceback.print_exc(limit=-3)
    print(f"\ndone in {elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(0)
