"""benchmarks/profile_step.py's trace analysis on a made-up trace: GPU work is counted to the step
whose launch made it (by the runtime call's correlation id), not to the host span it runs under."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_step as P  # noqa: E402


def _x(name, cat, ts, dur, **args):
    return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, args=args)


def test_kernels_belong_to_the_step_that_launched_them(tmp_path):
    # async scheduling: launch 0, launch 1, finish 0, launch 2, finish 1 ...; each launch's kernels
    # run while the host is already in the next launch and finish
    ev = []
    for k, t in enumerate((0.0, 1000.0, 2000.0)):
        ev.append(_x(f"{P.LAUNCH_TAG}{k}", "user_annotation", t, 100.0))
        ev.append(_x("cudaGraphLaunch", "cuda_runtime", t + 50, 10.0, correlation=10 * k + 1))
        ev.append(_x(f"{P.STEP_TAG}{k}", "user_annotation", t + 900, 50.0))
    gpu = {0: (200.0, 1150.0), 1: (1200.0, 2100.0), 2: (2300.0, 3200.0)}  # step 2 starts 200 us after 1 ends
    for k, (a, b) in gpu.items():
        half = (a + b) / 2
        ev.append(_x("_cascade_node_kernel", "kernel", a, half - a, correlation=10 * k + 1))
        ev.append(_x("nvjet_gemm", "kernel", half, b - half, correlation=10 * k + 1))
    ev.append(_x(f"{P.STEP_TAG}3", "user_annotation", 3500.0, 50.0))  # launched before the recording: left out
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    log = [dict(kind="cascade")] * 3
    rec = P.analyze_trace(str(path), log, {"kernel"})
    steps = {s["step"]: s for s in rec["steps"]}
    assert rec["active_steps"] == [0, 1, 2]
    assert [steps[k]["gpu_span_us"] for k in range(3)] == [950.0, 900.0, 900.0]
    assert [steps[k]["idle_prev_us"] for k in range(3)] == [None, 50.0, 200.0]
    assert steps[1]["attn_union_us"] == 450.0
    assert rec["wall_us"] == 3000.0 and rec["kernel_union_us"] == 2750.0
