"""Host time per eager ``paged_decode`` call, with the direct launch (kernels/launch.py) on and off.

One small request (default B=1, 8K tokens, Hq 32, Hkv 8, D 128, bf16, a plan) takes ~20 us of GPU
time, so an eager call is host-bound when its host time exceeds that. Each variant times N calls
with one ``torch.cuda.synchronize()`` at the end (best of 5 rounds):

  eager       the real calls: max(host, GPU) per call
  no launch   the compiled kernels' driver launches replaced by no-ops: all host work but the driver
  no kernels  ``decode_triton`` replaced by a no-op: the input checks and output allocation only

PAGED_BACKEND_DIRECT_LAUNCH is read at import, so each setting runs in a child process.

    python3 benchmarks/host_overhead.py [--calls 2000] [--len 8192] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from common import make_paged_inputs  # (puts the repository root on sys.path)

VARIANTS = ("eager", "no launch", "no kernels")


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def child(args) -> dict:
    import paged_backend as pb
    from paged_backend.kernels import decode as kernels_decode, launch
    from paged_backend import decode as public_decode

    inp = make_paged_inputs([args.len] * args.batch, 32, 8, 128, 16, torch.bfloat16, "cuda", rotate_sets=False)
    q, k, v = inp.sets[0]
    plan = pb.plan_decode(inp.lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda")
    call = lambda: pb.paged_decode(q, k, v, inp.block_table, inp.seq_lens, plan=plan)  # noqa: E731
    res = {"direct launch": launch.DISABLED_BY or "on", "eager": per_call_us(call, args.calls)}
    # No driver launches: the launchers of the compiled kernels (shared by both paths) do nothing.
    launchers = [compiled.run for fn in (kernels_decode._decode_kernel, kernels_decode._fold_states_kernel)
                 for cache in getattr(fn, "device_caches", {}).values() for compiled in cache[0].values()]
    if launchers and all(hasattr(r, "launch") for r in launchers):
        for r in launchers:
            r.launch = lambda *a: None
        res["no launch"] = per_call_us(call, args.calls)
    public_decode.decode_triton = lambda *a: None
    res["no kernels"] = per_call_us(call, args.calls)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"B={args.batch} x {args.len} tokens, {args.calls} calls a round; us per call")
    print(f"{'direct launch':>34s}" + "".join(f"{v:>12s}" for v in VARIANTS))
    for switch in ("1", "0"):
        env = dict(os.environ, PAGED_BACKEND_DIRECT_LAUNCH=switch)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"--calls={args.calls}", f"--len={args.len}",
               f"--batch={args.batch}"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"child with PAGED_BACKEND_DIRECT_LAUNCH={switch} failed:\n{done.stderr[-3000:]}")
        res = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{res['direct launch']:>34s}" + "".join(f"{res[v]:12.1f}" if v in res else f"{'n/a':>12s}"
                                                     for v in VARIANTS))


if __name__ == "__main__":
    main()
