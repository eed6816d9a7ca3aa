"""Host time of one CUDA graph replay (``cudaGraphLaunch``), by the graph's size and kind of nodes.

Why: an engine decode step is one graph replay, and on the H200 (2026-11-28, profile_step traces
in ``results/sweeps/engine_step_trace_compiled_*``) the replay call alone held the host 474 us for
the SmolLM2-shaped cascade step (~570 kernels) and 771 us for the 8B-shaped one (~370 kernels),
while the GPU idled for it: ~0.8-2 us of host per node. This finds what the launch cost grows with:
the node count, Triton vs ATen kernels, and kernels launched with programmatic dependent launch
(PDL, ``launch_pdl=True``: our decode, fold and cascade kernels on Hopper), alone or between
others, and cuBLAS's GEMMs (the model's linear layers). Answer (H200, 2026-11-28,
``results/sweeps/graph_replay_h200.txt``): 4-40 us for up to 1,024 nodes of any kind, and the
engine's own graphs replay in 6-38 us outside the profiler: the traces' launch time was CUPTI's.

    python3 benchmarks/graph_launch_check.py            # on a GPU; ~30 s
    python3 benchmarks/graph_launch_check.py --nodes 64,512 --reps 50

Each case: N nodes captured in one graph on a side stream, 3 warm-up replays, then ``--reps``
replays timed by ``perf_counter`` around ``replay()`` only, three ways: each on an idle GPU (a
synchronize between them: "idle"); each launched while the last one is still in flight behind a
~1 ms sleep kernel, as the engine's steps are ("queued"); and the same alternating two graphs
captured alike ("two graphs": whether relaunching an executable graph that is still in flight is
what costs). Prints a table: case, nodes, median host us a replay each way, us a node when idle.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _bump_kernel(x_ptr, PDL: tl.constexpr):
    # (PDL: wait for the previous grid's writes, then let the next kernel launch)
    if PDL:
        gdc_wait()
    v = tl.load(x_ptr)
    tl.store(x_ptr, v + 1.0)
    if PDL:
        gdc_launch_dependents()


def _aten(x):
    x.add_(1.0)


def _triton(x):
    _bump_kernel[(1,)](x, PDL=False)


def _triton_pdl(x):
    _bump_kernel[(1,)](x, PDL=True, launch_pdl=True)


_MM = {}


def _cublas(x):
    # a decode-shaped bf16 GEMM (64 rows x 576 -> 1536, SmolLM2's MLP): cuBLAS picks its Hopper kernels
    if x.device not in _MM:
        a = torch.randn(64, 576, device=x.device, dtype=torch.bfloat16)
        _MM[x.device] = (a, torch.randn(1536, 576, device=x.device, dtype=torch.bfloat16).t(),
                         torch.empty(64, 1536, device=x.device, dtype=torch.bfloat16))
    a, b, out = _MM[x.device]
    torch.mm(a, b, out=out)


CASES = {
    "aten": [_aten],
    "triton": [_triton],
    "triton_pdl": [_triton_pdl],
    "aten+triton_pdl": [_aten, _triton_pdl],  # PDL kernels between ATen ones, as in the engine's step
    "cublas": [_cublas],
    "cublas+triton_pdl": [_cublas, _triton_pdl],
}


def make_graph(fns, nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph of ``nodes`` launches cycling ``fns`` on ``x``, its kernels compiled before the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(nodes):
            fns[i % len(fns)](x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(nodes):
            fns[i % len(fns)](x)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    return g


def replay_us(fns, nodes: int, reps: int) -> tuple[float, float, float]:
    """Median host microseconds of one replay of a graph of ``nodes`` launches cycling ``fns``: on an
    idle GPU, queued behind the previous replay of the same graph, and alternating two graphs."""
    x = torch.zeros(1, device="cuda")
    graphs = [make_graph(fns, nodes, x), make_graph(fns, nodes, x)]

    def timed(order, sync: bool) -> float:
        times = []
        for g in order:
            if not sync:  # keep the GPU busy (~1 ms) so that the last replay is still in flight
                torch.cuda._sleep(2_000_000)
            t0 = time.perf_counter()
            g.replay()
            times.append(time.perf_counter() - t0)
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return statistics.median(times[1:]) * 1e6  # (the first queued one starts on an idle GPU)

    idle = timed([graphs[0]] * reps, True)
    queued = timed([graphs[0]] * reps, False)
    two = timed([graphs[i % 2] for i in range(reps)], False)
    return idle, queued, two


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="16,128,512,1024", help="comma-separated node counts")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    nodes = [int(n) for n in args.nodes.split(",")]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} CUDA {torch.version.cuda} | "
          f"Triton {triton.__version__}")
    print(f"{'case':<18}{'nodes':>7}{'idle us':>10}{'us/node':>9}{'queued us':>11}{'two graphs us':>15}")
    for name in args.cases.split(","):
        for n in nodes:
            idle, queued, two = replay_us(CASES[name], n, args.reps)
            print(f"{name:<18}{n:>7}{idle:>10.1f}{idle / n:>9.2f}{queued:>11.1f}{two:>15.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
