"""Host time of the engine's steady decode step without the model: n samples of one prompt decoding,
each step ``Scheduler.schedule``, the decode graph's inputs written (``StaticInputs.fill``), the cascade
plan carried over into its arena (``CascadeGraphs._plan``) and ``Scheduler.postprocess`` - the host
work that must stay under a step's GPU time for the GPU never to wait (docs/benchmarks.md). On the
CPU the "device" buffers are host memory; ``--device cuda`` times the writes into pinned memory
(which a graph's first kernels read) on a GPU machine's host.

    python3 benchmarks/bench_host_step.py [--quick] [--device cpu|cuda (default: cuda where there is one)]
                                          [--steps 200] [--out R.json]

Shapes: SmolLM2-135M's heads (9 / 3, D 64) and Llama-3-8B's (32 / 8, D 128); prompts of 4K and 32K
tokens, 64 samples, BS 16. us per step (median, and p90 over the steps).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from paged_backend.integration.cascade_graphs import CascadeGraphs  # noqa: E402
from paged_backend.integration.graphs import StaticInputs, padded_size  # noqa: E402
from paged_backend.integration.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from paged_backend.integration.step import StepBuilder  # noqa: E402
from paged_backend.scheduler import BlockManager, SamplingParams, Scheduler  # noqa: E402

BENCH = "host_step"
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # q heads, KV heads, head dim
PARTS = ("schedule", "fill", "plan", "postprocess")


def run(shape, prompt: int, n: int, steps: int, device: torch.device, bs: int = 16) -> dict:
    hq, hkv, d = SHAPES[shape]
    gen = steps + 32
    num_blocks = prompt // bs + n * (-(-gen // bs) + 2) + 64
    spec = KVCacheSpec(1, hkv, d, bs, torch.bfloat16, device)  # (one layer: the plan does not depend on them)
    cache = PagedKVCache(spec, num_blocks)
    builder = StepBuilder(cache, num_q_heads=hq)
    sched = Scheduler(BlockManager(num_blocks, bs, watermark=0.0), max_num_seqs=n, max_num_batched_tokens=16384)
    rng = np.random.default_rng(0)
    sched.add_request(rng.integers(0, 32000, prompt).tolist(), SamplingParams(n=n, max_tokens=gen), request_id=0)
    while True:  # prefill, then the fork into n samples
        b = sched.schedule()
        sched.postprocess(b, rng.integers(0, 32000, int(b.num_samples.sum())))
        if b.num_decodes == n:
            break
    graphs = CascadeGraphs(None, cache, builder, max_num_seqs=n, max_model_len=prompt + gen + bs, capture=False)
    inp = StaticInputs(padded_size(n), graphs.width, device)
    times = {k: [] for k in PARTS}
    for i in range(steps + 16):
        t0 = time.perf_counter()
        b = sched.schedule()
        t1 = time.perf_counter()
        inp.fill(b)
        t2 = time.perf_counter()
        graphs._plan(b, inp)
        t3 = time.perf_counter()
        sched.postprocess(b, rng.integers(0, 32000, n))
        t4 = time.perf_counter()
        if i >= 16:  # (the first steps find the forest and grow the arena)
            for k, a, z in zip(PARTS, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                times[k].append(z - a)
    total = [sum(x) for x in zip(*times.values())]
    return {k: dict(median_us=float(np.median(v) * 1e6), p90_us=float(np.percentile(v, 90) * 1e6))
            for k, v in {**times, "total": total}.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small case (smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", help="results JSON (default: none on the CPU, benchmarks/results/<gpu>.json on a GPU)")
    a = p.parse_args()
    device = torch.device(a.device)
    cases = [("smollm2-135m", 256, 8, 20)] if a.quick else [(s, L, 64, a.steps) for s in SHAPES for L in (4096, 32768)]
    rows, results = [], {}
    for shape, prompt, n, steps in cases:
        r = results[f"{shape}:{prompt}x{n}"] = run(shape, prompt, n, steps, device)
        rows.append([shape, f"{prompt} x {n}", *(f"{r[k]['median_us']:.0f} ({r[k]['p90_us']:.0f})" for k in (*PARTS, "total"))])
    table = C.md_table(["shape", "prompt x samples", *PARTS, "total"], rows)
    print(f"{device} host ({C.now()}): us per step, median (p90)")
    print(table)
    if device.type == "cuda" and not a.quick:  # (a GPU machine's host: with its other results)
        C.save_results(device, BENCH, results, f"## Host time of a steady cascade decode step ({C.gpu_name(device)}'s "
                       f"host, {C.now()})\n\nus per step, median (p90), no model (bench_host_step.py).\n\n{table}\n",
                       a.out)
    elif a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(device), "date": C.now(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
