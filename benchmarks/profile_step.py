"""Profile the engine's steady decode steps ("the engine gets a quarter of what our kernels allow").

    python3 benchmarks/profile_step.py                    # on an H100/H200, repo root; < 5 min
    python3 benchmarks/profile_step.py --cases smol_auto --steps 32 --prompt-len 2048 -n 32
    python3 benchmarks/profile_step.py --smoke            # CPU smoke run: tiny model, no CUDA parts

Cases (models and LLM keyword arguments from benchmarks/bench_e2e.py, random weights, bf16):
``smol_flat`` SmolLM2-135M shape, every decode flat in CUDA graphs (``LLM(cascade=False)``);
``smol_auto`` the same model as the engine comes (cascade allowed, PathChoice picks: under the profiler its
timed cascade steps are host-bound, and some of the profiled run's steps go flat - the kinds each line shows,
results/sweeps/engine_step_ends_h200.log section 6); ``smol_cascade``
every shared decode step a cascade (in CUDA graphs);
``llama8b_auto`` Llama-3-8B shape cut to 16 layers, as the engine comes.

Per case, on one LLM (``profile=True``): two warm-ups (one as long as the measured runs, so every
kernel specialisation is compiled and every graph captured before anything is measured; one of a
few tokens), then three generates of one ``--prompt-len`` prompt (a fresh one each: no prefix-cache
hit), ``n`` samples, ``--steps`` new tokens each, ignore_eos, temperature 1.0:

1. clean: decode tok/s, median step total/host/gpu/attend ms from ``last_stats.step_log``;
2. torch.profiler (CPU + CUDA) on ``--active`` decode steps in the middle (schedule wait/warmup=2/
   active, driven by ``prof.step()`` after each engine step through a wrapper of ``LLM._finish``):
   per-kernel table, GPU busy fraction (union of kernel intervals / wall span of the active steps;
   kernels under programmatic dependent launch start early and wait, so sums of durations overlap:
   both the sum and the union are given), the attention kernels' union per step, the idle gaps
   between steps, the host lead-in (step start -> first kernel) and tail (last kernel -> step end);
3. cProfile of 8 steady steps (enabled inside their wrapped ``_launch`` and ``_finish``), top 30 by cumulative.

Files under $OUT (default /tmp/prof-out), at most 8: profile_report.txt (all that is printed),
trace_<case>.json.gz (chrome traces of the active steps), cprofile_<case>.pstats, step_logs.json.
"""
from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _p in (BENCH, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

try:  # installed (pip install -e .): paged_backend.integration is the top-level integration/
    import paged_backend.integration  # noqa: E402,F401
except ImportError:  # not installed: the repository's top-level folders serve as paged_backend's subpackages
    import paged_backend  # noqa: E402
    paged_backend.__path__.append(ROOT)
    import paged_backend.integration  # noqa: E402,F401

import bench_e2e as E  # noqa: E402  (imports benchmarks/common.py, which puts the repo root on sys.path)
import common as C  # noqa: E402
from paged_backend.integration import LLM, SamplingParams  # noqa: E402

CASES = {  # name -> (bench_e2e model, bench_e2e engine: its LLM keyword arguments)
    "smol_flat": ("smollm2-135m", "ours_flat"),
    "smol_auto": ("smollm2-135m", "ours"),
    "smol_cascade": ("smollm2-135m", "ours_cascade_graphs"),
    "llama8b_auto": ("llama3-8b-16l", "ours"),
}
ATTN_PATTERNS = ("_decode_kernel", "_fold_states_kernel", "cascade", "node", "_merge_states_kernel",
                 "_merge_gathered_kernel")
STEP_TAG = "engine_step#"
LAUNCH_TAG = "engine_launch#"

T0 = time.perf_counter()
REPORT: list[str] = []


def say(*parts, progress: bool = False) -> None:
    """Prints (flushed) and keeps the line for profile_report.txt; progress lines carry a timestamp."""
    line = " ".join(str(p) for p in parts)
    if progress:
        line = f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {line}"
    print(line, flush=True)
    REPORT.append(line)


# ----------------------------------------------------------------------------- the step hook
class StepHook:
    """Wraps ``LLM._launch`` and ``LLM._finish`` (class-level): counts the steps of the current
    generate, marks each finish with a ``record_function`` span, calls ``prof.step()`` after it, and
    runs cProfile inside the launches and finishes of chosen steps (steps overlap under async
    scheduling: step t+1 is launched before step t is finished)."""

    def __init__(self):
        self.orig = LLM._launch, LLM._finish
        self.reset()
        hook = self

        def _launch(llm, *args):
            k = hook.launched
            hook.launched += 1
            with torch.profiler.record_function(f"{LAUNCH_TAG}{k}"):  # (its kernels: launched inside)
                return hook._profiled(k, hook.orig[0], llm, *args)

        def _finish(llm, *args):
            k = hook.count
            hook.count += 1
            try:
                with torch.profiler.record_function(f"{STEP_TAG}{k}"):
                    return hook._profiled(k, hook.orig[1], llm, *args)
            finally:
                if hook.prof is not None:
                    hook.prof.step()
        LLM._launch, LLM._finish = _launch, _finish

    def _profiled(self, k, fn, *args):
        prof = self.cprofile if k in self.cprofile_steps else None
        if prof is None:
            return fn(*args)
        prof.enable()
        try:
            return fn(*args)
        finally:
            prof.disable()

    def reset(self, prof=None, cprofile=None, cprofile_steps=()):
        self.count = self.launched = 0
        self.prof, self.cprofile, self.cprofile_steps = prof, cprofile, set(cprofile_steps)

    def remove(self):
        LLM._launch, LLM._finish = self.orig


# ----------------------------------------------------------------------------- helpers
def med_ms(log, key, idx=None):
    vals = [s[key] for i, s in enumerate(log) if (idx is None or i in idx) and s.get(key) is not None]
    return statistics.median(vals) * 1e3 if vals else float("nan")


def decode_idx(log):
    return {i for i, s in enumerate(log) if s.get("kind") != "prefill"}


def union_len(intervals) -> float:
    """Total length of the union of [a, b] intervals."""
    tot, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                tot += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        tot += cur_b - cur_a
    return tot


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def generate(llm, prompt, n, new, seed):
    outs = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=n, max_tokens=new, ignore_eos=True,
                                                                     temperature=1.0, seed=seed), use_tqdm=False)
    got = sum(len(c.token_ids) for c in outs[0].outputs)
    assert got == n * new, f"generated {got} tokens, expected {n * new}"
    sync(llm.device)
    return llm.last_stats


def summarize_run(tag, st, n, new, idx=None):
    log = st.step_log
    dec = decode_idx(log)
    sel = dec if idx is None else dec & set(idx)
    kinds = {}  # the paths the selected steps took (cascade, graph = flat in a CUDA graph, ...)
    for i in sorted(sel):
        kinds[log[i]["kind"]] = kinds.get(log[i]["kind"], 0) + 1
    tok_s = n * (new - 1) / st.decode_time if st.decode_time else float("nan")
    head = (f"decode {tok_s:,.0f} tok/s ({len(dec)} decode steps {kinds}, prefill {st.prefill_time * 1e3:.1f} ms,"
            f" wall {st.wall_time:.3f} s); " if idx is None else "")
    say(f"  {tag}: {head}median over {len(sel)} steps{'' if idx is None else f' {kinds}'}: "
        f"total {med_ms(log, 'total_s', sel):.3f} ms,"
        f" host {med_ms(log, 'host_s', sel):.3f} ms, gpu {med_ms(log, 'gpu_s', sel):.3f} ms,"
        f" attend {med_ms(log, 'attend_s', sel):.3f} ms")
    return dict(decode_tok_s=tok_s, kinds=kinds, step_ms=med_ms(log, "total_s", sel),
                host_ms=med_ms(log, "host_s", sel), gpu_ms=med_ms(log, "gpu_s", sel),
                attend_ms=med_ms(log, "attend_s", sel))


# ----------------------------------------------------------------------------- trace analysis
def analyze_trace(path, log, kernel_cats, top=25):
    """Per-kernel table, busy fraction, attention union and gaps of the active steps in a chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]
    spans = {STEP_TAG: {}, LAUNCH_TAG: {}}
    for e in evs:
        for tag, into in spans.items():
            if e.get("name", "").startswith(tag) and e.get("cat") != "gpu_user_annotation":
                into[int(e["name"][len(tag):])] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    steps, launches_of = spans[STEP_TAG], spans[LAUNCH_TAG]
    # the active steps: finished and launched inside the recording (step t is launched before step
    # t-1 finishes, so the first finished step's launch may lie before the window opened)
    order = sorted(k for k in steps if k in launches_of)
    if not order:
        say("  (no step with both its launch and its finish in the trace)")
        return {}
    kernels = [e for e in evs if e.get("cat") in kernel_cats]
    if not kernels:
        say(f"  WARNING: no {sorted(kernel_cats)} events in the trace (CUPTI missed the graph kernels?)")
    copies = [e for e in evs if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    # A GPU event belongs to the step whose launch made it: its runtime call (same correlation id)
    # lies in that step's launch span. (Under async scheduling step t's kernels run while the host
    # finishes step t-1 and launches t+1: their start times say nothing of their step.)
    called = {e["args"]["correlation"]: float(e["ts"]) for e in evs
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def step_of(e):
        ts = called.get(e.get("args", {}).get("correlation"))
        if ts is not None:
            for k in order:
                a, b = launches_of.get(k, (None, None))
                if a is not None and a <= ts <= b:
                    return k
        return None

    def assign(events):
        per = {k: [] for k in order}
        for e in events:
            k = step_of(e)
            if k is not None:
                ts = float(e["ts"])
                per[k].append((ts, ts + float(e["dur"]), e.get("name", "?")))
        return per

    kper, cper = assign(kernels), assign(copies)
    ns = len(order)
    allk = [iv for k in order for iv in kper[k]]
    if not allk:
        say("  (no kernels matched to the active steps' launches)")
        return {}
    wall = max(b for _, b, _ in allk) - min(a for a, _, _ in allk)  # the active steps' GPU work, end to end
    allc = [iv for k in order for iv in cper[k]]
    ksum = sum(b - a for a, b, _ in allk)
    kunion = union_len([(a, b) for a, b, _ in allk])
    cunion = union_len([(a, b) for a, b, _ in allk + allc])
    attn = [iv for iv in allk if any(p in iv[2] for p in ATTN_PATTERNS)]
    say(f"  trace: {ns} active steps {order[0]}..{order[-1]} (kinds "
        f"{[log[k]['kind'] if k < len(log) else '?' for k in order]}), wall span {wall / 1e3:.3f} ms "
        f"({wall / ns:.1f} us/step); {len(allk)} kernels ({len(allk) / ns:.1f}/step)")
    say(f"  GPU busy: union of kernels {kunion / ns:.1f} us/step = {kunion / wall * 100 if wall else 0:.1f}% of the"
        f" wall span; sum of kernel durations {ksum / ns:.1f} us/step ({ksum / wall * 100 if wall else 0:.1f}%;"
        f" sum/union {ksum / kunion if kunion else 0:.2f}: >1 = overlap, PDL); with memcpy/memset"
        f" {cunion / ns:.1f} us/step ({len(allc) / ns:.1f} copies/step, {sum(b - a for a, b, _ in allc) / ns:.1f} us/step)")
    launches = [float(e["dur"]) for e in evs if e.get("name") == "cudaGraphLaunch"
                and any(a <= float(e["ts"]) <= b for a, b in launches_of.values())]
    if launches:  # (under the profiler: CUPTI's instrumentation makes it ~100x its 6-38 us, graph_replay_h200.txt)
        say(f"  cudaGraphLaunch: {len(launches)} calls, median {statistics.median(launches):.1f} us of host each"
            " (inflated by the profiler)")
    say(f"  attention kernels ({', '.join(ATTN_PATTERNS)}): union {union_len([(a, b) for a, b, _ in attn]) / ns:.1f}"
        f" us/step, sum {sum(b - a for a, b, _ in attn) / ns:.1f} us/step, {len(attn) / ns:.1f} calls/step")
    # per-kernel table
    table = {}
    for a, b, name in allk:
        t = table.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += b - a
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    say(f"  {'kernel (top %d of %d by total)' % (min(top, len(rows)), len(rows)):<60}  {'calls/st':>8}  {'us/step':>9}"
        f"  {'mean us':>8}  {'%sum':>5}")
    for name, (cnt, tot) in rows[:top]:
        say(f"  {name[:60]:<60}  {cnt / ns:8.2f}  {tot / ns:9.1f}  {tot / cnt:8.2f}  {tot / ksum * 100 if ksum else 0:5.1f}")
    if len(rows) > top:
        rest = sum(t for _, (_, t) in rows[top:])
        say(f"  {'(the other %d)' % (len(rows) - top):<60}  {sum(c for _, (c, _) in rows[top:]) / ns:8.2f}"
            f"  {rest / ns:9.1f}")
    # per step, on the GPU: its kernels' span, and the idle since the previous step's last kernel
    say(f"  {'step':>4} {'kind':>8} {'gpu span':>8} {'k-union':>8} {'k-sum':>8} {'busy%':>6} {'attn-un':>8}"
        f" {'idle-prev':>9} {'host_ms':>7} {'total_ms':>8} {'gpu_ms':>7} {'attend_ms':>9}")
    prev_end, gaps, rec_steps = None, [], []
    for k in order:
        ks = kper[k]
        un = union_len([(x, y) for x, y, _ in ks])
        sm = sum(y - x for x, y, _ in ks)
        at = union_len([(x, y) for x, y, nm in ks if any(p in nm for p in ATTN_PATTERNS)])
        first = min((x for x, _, _ in ks), default=None)
        last = max((y for _, y, _ in ks), default=None)
        gap = (first - prev_end) if (first is not None and prev_end is not None) else None
        if gap is not None:
            gaps.append(gap)
        period = None if last is None else last - (first if prev_end is None else min(prev_end, first))
        s = log[k] if k < len(log) else {}
        f = lambda v, m=1e3, d=3: "" if v is None else f"{v * m:.{d}f}"  # noqa: E731
        say(f"  {k:>4} {s.get('kind', '?'):>8} {f(None if last is None else last - first, 1, 1):>8} {un:8.1f} {sm:8.1f}"
            f" {f(un / period if period else None, 100, 1):>6} {at:8.1f} {f(gap, 1, 1):>9} {f(s.get('host_s')):>7}"
            f" {f(s.get('total_s')):>8} {f(s.get('gpu_s')):>7} {f(s.get('attend_s')):>9}")
        rec_steps.append(dict(step=k, kind=s.get("kind"), gpu_span_us=None if last is None else last - first,
                              kernel_union_us=un, kernel_sum_us=sm, attn_union_us=at, idle_prev_us=gap))
        if last is not None:
            prev_end = last
    if gaps:
        idle = [max(0.0, g) for g in gaps]
        say(f"  GPU idle between consecutive steps (a step's last kernel -> the next one's first): median"
            f" {statistics.median(idle):.1f} us, max {max(idle):.1f} us, {sum(idle) / wall * 100:.1f}% of the span")
    return dict(active_steps=order, wall_us=wall, kernel_union_us=kunion, kernel_sum_us=ksum,
                busy_frac=kunion / wall if wall else None, attn_union_us_per_step=union_len([(a, b) for a, b, _ in attn]) / ns,
                kernels=[dict(name=nm, calls_per_step=c / ns, us_per_step=t / ns) for nm, (c, t) in rows],
                steps=rec_steps)


# ----------------------------------------------------------------------------- one case
def run_case(case, model, prompt, args, hook, out_dir, device):
    mname, eng = CASES[case] if not args.smoke else ("tiny", CASES[case][1])
    kwargs = dict(E.OURS[eng])
    always = kwargs.pop("always_cascade", False)
    n, new = args.n, args.steps
    say(f"=== {case}: {mname}, LLM kwargs {kwargs or '{}'}, prompt {len(prompt)}, n={n}, max_tokens={new}", progress=True)
    t = time.perf_counter()
    llm = LLM(model, device=device, dtype=torch.bfloat16, max_num_seqs=n, max_model_len=len(prompt) + new + 16,
              profile=True, **kwargs)
    if always and llm.choice is not None:
        llm.choice.PROBES = 2 ** 62
    say(f"  LLM built (graphs captured) in {time.perf_counter() - t:.1f} s; max_num_batched_tokens "
        f"{llm._sched_args.get('max_num_batched_tokens')}", progress=True)
    shifted = lambda d: [t - d for t in prompt]  # noqa: E731  (prompt ids are >= 10: fresh prompts, no prefix hit)
    rec = {}
    hook.reset()
    generate(llm, shifted(1), n, new, seed=1)  # warm-up as long as the runs below: every specialisation compiled
    generate(llm, shifted(2), n, 4, seed=2)    # ... and a short one from a fresh prompt
    say("  warm-ups done", progress=True)

    # 1. clean run
    hook.reset()
    st = generate(llm, prompt, n, new, seed=0)
    rec["clean"] = summarize_run("clean run", st, n, new)
    rec["clean"]["step_log"] = st.step_log

    # 2. torch.profiler on the middle decode steps
    mbt = llm._sched_args.get("max_num_batched_tokens") or 8192
    prefill_steps = -(-len(prompt) // mbt)
    ndec = new - 1
    active = max(1, min(args.active, ndec - 2))
    first = prefill_steps + max(0, (ndec - active) // 2)
    warmup = min(2, first)
    wait = first - warmup
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    tmp = tempfile.mkdtemp(prefix="profstep-")
    raw = os.path.join(tmp, f"trace_{case}.json")
    ready = []

    def on_ready(p):
        p.export_chrome_trace(raw)
        ready.append(raw)

    sched = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    with torch.profiler.profile(activities=acts, schedule=sched, on_trace_ready=on_ready, record_shapes=False,
                                with_stack=False) as prof:
        hook.reset(prof=prof)
        try:
            st = generate(llm, shifted(3), n, new, seed=3)
        finally:
            hook.reset()
    say(f"  profiled run: steps {first}..{first + active - 1} active (wait {wait}, warmup {warmup})", progress=True)
    rec["profiled"] = summarize_run("profiled run (all decode steps)", st, n, new)
    act_idx = set(range(first, first + active))
    rec["profiled_active"] = summarize_run("  its active steps (under the profiler)", st, n, new, idx=act_idx)
    rest = decode_idx(st.step_log) - act_idx - set(range(first - warmup, first))
    rec["profiled_rest"] = summarize_run("  its steps outside the profiler", st, n, new, idx=rest)
    if ready:
        kcats = {"kernel"} if device.type == "cuda" else {"cpu_op"}  # (CPU smoke: aten ops stand in for kernels)
        if device.type != "cuda":
            say("  (CPU smoke: 'kernels' below are aten cpu_op events, to exercise the analysis)")
        rec["trace"] = analyze_trace(raw, st.step_log, kcats)
        gz = os.path.join(out_dir, f"trace_{case}.json.gz")
        with open(raw, "rb") as fi, gzip.open(gz, "wb", compresslevel=6) as fo:
            fo.write(fi.read())
        mb = os.path.getsize(gz) / 1e6
        say(f"  trace -> {gz} ({os.path.getsize(raw) / 1e6:.1f} MB raw, {mb:.1f} MB gz)"
            + ("  WARNING: over 15 MB, rerun with fewer --active steps" if mb > 15 else ""), progress=True)
        os.remove(raw)
    else:
        say("  (no trace: the profiler's active window was not reached)")

    # 3. cProfile of 8 steady decode steps
    c0 = max(prefill_steps, min(args.cprofile_start, prefill_steps + ndec - 8))  # engine step index (0: prefill)
    csteps = [s for s in range(c0, c0 + 8) if s < prefill_steps + ndec]
    cp = cProfile.Profile()
    hook.reset(cprofile=cp, cprofile_steps=csteps)
    try:
        st = generate(llm, shifted(4), n, new, seed=4)
    finally:
        hook.reset()
    summarize_run(f"cProfile run (steps {csteps[0]}..{csteps[-1]} profiled)", st, n, new, idx=set(csteps))
    cp.dump_stats(os.path.join(out_dir, f"cprofile_{case}.pstats"))
    for sort, count in (("cumulative", 30), ("tottime", 20)):
        buf = io.StringIO()
        ps = pstats.Stats(cp, stream=buf)
        ps.sort_stats(sort).print_stats(count)
        text = buf.getvalue()
        text = text.replace(ROOT + os.sep, "").replace(os.path.dirname(torch.__path__[0]) + os.sep, "")
        say(f"  cProfile of {len(csteps)} steps, top {count} by {sort} (seconds are totals over the {len(csteps)} steps):")
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith(("Ordered by", "List reduced")):
                say("    " + line)
    del llm
    C.free_memory()
    say(f"=== {case} done", progress=True)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--steps", type=int, help="new tokens per sample (max_tokens) of each run (default 48; smoke 24)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default 4096; smoke 64)")
    p.add_argument("-n", type=int, help="samples of the prompt (default 64; smoke 4)")
    p.add_argument("--active", type=int, default=8, help="decode steps the torch profiler records")
    p.add_argument("--cprofile-start", type=int, default=10, help="first engine step under cProfile (8 steps; step 0 is the prefill)")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/prof-out", help="output folder (default $OUT)")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny model, short prompt, no CUDA parts")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown cases {bad}; choose from {list(CASES)}")
    for key, full, smoke in (("steps", 48, 24), ("prompt_len", 4096, 64), ("n", 64, 4)):
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.smoke:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device (use --smoke for a CPU run)")
        device = torch.device("cuda")
    if args.steps < 4:
        p.error("--steps must be >= 4")
    os.makedirs(args.out, exist_ok=True)
    import triton
    say(f"profile_step: {C.gpu_name()}, torch {torch.__version__}, triton {triton.__version__}, python "
        f"{sys.version.split()[0]}; cases {cases}; prompt {args.prompt_len}, n {args.n}, max_tokens {args.steps},"
        f" active {args.active}; out {args.out}", progress=True)
    hook = StepHook()
    results = {}
    report = os.path.join(args.out, "profile_report.txt")
    try:
        by_model = {}
        for c in cases:
            by_model.setdefault("tiny" if args.smoke else CASES[c][0], []).append(c)
        for mname, mcases in by_model.items():
            shape = E.QUICK_MODELS["tiny"] if args.smoke else E.MODELS[mname]
            t = time.perf_counter()
            model = E.build(shape, device, torch.bfloat16, args.prompt_len + args.steps + 64)
            say(f"model {mname} built in {time.perf_counter() - t:.1f} s "
                f"({sum(q.numel() for q in model.parameters()) / 1e9:.3f} B params)", progress=True)
            prompt = torch.randint(10, shape["vocab_size"], (args.prompt_len,),
                                   generator=torch.Generator().manual_seed(1)).tolist()
            for c in mcases:
                try:
                    results[c] = run_case(c, model, prompt, args, hook, args.out, device)
                except Exception as e:  # noqa: BLE001 - report and go on with the next case
                    import traceback
                    say(f"=== {c} FAILED: {C.short_error(e)}", progress=True)
                    for line in traceback.format_exc().splitlines():
                        say("    " + line)
                    results[c] = {"error": C.short_error(e)}
                    C.free_memory()
                with open(report, "w") as f:  # after every case: a timeout still leaves the report
                    f.write("\n".join(REPORT) + "\n")
            del model
            C.free_memory()
        say("summary (clean runs): case, decode tok/s, step ms, host ms, gpu ms, attend ms; trace busy%, attn us/step")
        for c, r in results.items():
            if "error" in r:
                say(f"  {c:<14} error: {r['error'][:100]}")
                continue
            cl, tr = r["clean"], r.get("trace") or {}
            busy = tr.get("busy_frac")
            say(f"  {c:<14} {cl['decode_tok_s']:>9,.0f} {cl['step_ms']:8.3f} {cl['host_ms']:8.3f} {cl['gpu_ms']:8.3f}"
                f" {cl['attend_ms']:8.3f}   busy {'' if busy is None else f'{busy * 100:.1f}%'}"
                f"  attn {tr.get('attn_union_us_per_step', float('nan')):.1f}")
    finally:
        hook.remove()
        with open(os.path.join(args.out, "step_logs.json"), "w") as f:
            json.dump(results, f, default=str)
        say(f"done in {time.perf_counter() - T0:.1f} s; files: {sorted(os.listdir(args.out))}", progress=True)
        with open(report, "w") as f:
            f.write("\n".join(REPORT) + "\n")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
