"""Host time per scheduler step with many running sequences (CPU only, numpy).

Default: 128 requests x 8 samples = 1024 running sequences, prompt 2048 tokens, BS 16. The
prompts are prefilled (chunked) and forked first; then decode steps are timed:
``schedule()`` (block growth, copy-on-write, batch arrays, share groups) and ``postprocess()``
(append sampled tokens, stop checks) separately. Writes benchmarks/results/cpu_scheduler.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paged_backend.scheduler import BlockManager, SamplingParams, Scheduler  # noqa: E402


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e6, q))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cpu_scheduler.json"))
    a = ap.parse_args()
    bs, nseq = a.block_size, a.groups * a.n
    gen = a.steps + 64
    num_blocks = a.groups * (a.prompt // bs) + nseq * (-(-gen // bs) + 2) + 64
    sched = Scheduler(BlockManager(num_blocks, bs, watermark=0.0), max_num_seqs=nseq,
                      max_num_batched_tokens=max(16384, nseq))
    rng = np.random.default_rng(0)
    for i in range(a.groups):
        sched.add_request(rng.integers(0, 32000, a.prompt).tolist(),
                          SamplingParams(n=a.n, max_tokens=gen), request_id=i)
    t0 = time.perf_counter()
    prefill_steps = 0
    while True:  # prefill + fork
        b = sched.schedule()
        sched.postprocess(b, rng.integers(0, 32000, int(b.num_samples.sum())))
        prefill_steps += 1
        if b.num_decodes == nseq:
            break
    t_prefill = time.perf_counter() - t0
    ts, tp, cs, cp = [], [], [], []
    clock, cpu = time.perf_counter, time.thread_time  # wall, and CPU time of this thread
    for _ in range(a.steps):
        c1, t1 = cpu(), clock()
        b = sched.schedule()
        t2, c2 = clock(), cpu()
        toks = rng.integers(0, 32000, int(b.num_samples.sum()))
        c3, t3 = cpu(), clock()
        sched.postprocess(b, toks)
        t4, c4 = clock(), cpu()
        assert b.num_decodes == nseq and not b.preempted
        ts.append(t2 - t1)
        tp.append(t4 - t3)
        cs.append(c2 - c1)
        cp.append(c4 - c3)
    tt = [x + y for x, y in zip(ts, tp)]
    ct = [x + y for x, y in zip(cs, cp)]
    st = sched.bm.stats()
    res = {
        "config": {"groups": a.groups, "n": a.n, "running_seqs": nseq, "prompt": a.prompt,
                   "block_size": bs, "num_blocks": num_blocks, "steps": a.steps},
        "host": {"python": platform.python_version(), "numpy": np.__version__,
                 "machine": platform.machine(), "processor": platform.processor()},
        "schedule_us": {"median": pct(ts, 50), "p90": pct(ts, 90)},
        "postprocess_us": {"median": pct(tp, 50), "p90": pct(tp, 90)},
        "step_total_us": {"median": pct(tt, 50), "p90": pct(tt, 90)},
        "schedule_cpu_us": {"median": pct(cs, 50), "p90": pct(cs, 90)},
        "postprocess_cpu_us": {"median": pct(cp, 50), "p90": pct(cp, 90)},
        "step_total_cpu_us": {"median": pct(ct, 50), "p90": pct(ct, 90)},
        "load_avg_1min": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "block_tables_shape": list(b.block_tables.shape),
        "share_groups": len(b.share_groups),
        "prefill_phase": {"steps": prefill_steps, "seconds": t_prefill},
        "block_stats": st,
    }
    print(f"{nseq} running seqs ({a.groups} x {a.n}), prompt {a.prompt}, BS {bs}, "
          f"block_tables {tuple(b.block_tables.shape)}, {len(b.share_groups)} share groups")
    for k in ("schedule_us", "postprocess_us", "step_total_us", "schedule_cpu_us",
              "postprocess_cpu_us", "step_total_cpu_us"):
        print(f"  {k:19s} median {res[k]['median']:8.1f}  p90 {res[k]['p90']:8.1f}")
    print(f"  (wall and thread-CPU time; load average {res['load_avg_1min']:.2f} on "
          f"{res['cpu_count']} CPUs)")
    print(f"  shared fraction {st['shared_fraction']:.3f}, blocks saved {st['blocks_saved']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
