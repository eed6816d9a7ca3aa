"""Decode-shaped projections apart vs joined (``integration/fused_linears.py``): q/k/v and gate/up of
a layer as separate GEMMs or as one GEMM over their weights laid end to end, the same outputs checked
first. Times in CUDA graphs (what the engine's steps replay), 8 layers' weights rotated past the L2.

    python3 benchmarks/bench_fused_linears.py [--rows 1,64,256] [--quick] [--out R.json] [--md R.md]

Shapes: SmolLM2-135M (576 -> 576/192/192, 576 -> 2 x 1536), Llama-3-8B (4096 -> 4096/1024/1024,
4096 -> 2 x 14336). us per layer's group, and the weights' bytes over that time.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

BENCH = "fused_linears"
SHAPES = {  # model: (hidden, {group: output widths})
    "smollm2-135m": (576, {"qkv": [576, 192, 192], "gate_up": [1536, 1536]}),
    "llama3-8b": (4096, {"qkv": [4096, 1024, 1024], "gate_up": [14336, 14336]}),
}
LAYERS = 8  # weight sets rotated through (8B gate/up: 1.9 GB, past any L2)


def layer_sets(hidden: int, widths: list, layers: int, device, dtype):
    """``layers`` weight groups, each laid end to end in one buffer -> [(parts, whole)]."""
    sets = []
    for _ in range(layers):
        whole = torch.randn(sum(widths), hidden, device=device, dtype=dtype) / hidden ** 0.5
        sets.append((list(whole.split(widths)), whole))
    return sets


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--rows", default="1,64,256", help="decode rows (tokens) per step")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {"tiny": (64, {"qkv": [64, 16, 16], "gate_up": [128, 128]})} if a.quick else SHAPES
    rows_list = [4] if a.quick else [int(r) for r in a.rows.split(",")]
    table, results = [], {}
    for model, (hidden, groups) in shapes.items():
        for group, widths in groups.items():
            sets = layer_sets(hidden, widths, 2 if a.quick else LAYERS, device, dtype)
            nbytes = sum(widths) * hidden * torch.finfo(dtype).bits // 8
            for rows in rows_list:
                x = torch.randn(rows, hidden, device=device, dtype=dtype)
                apart = [lambda ws=ws: [F.linear(x, w) for w in ws] for ws, _ in sets]
                joined = [lambda wh=wh: F.linear(x, wh).split(widths, -1) for _, wh in sets]
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
                for u, v in zip(apart[0](), joined[0]()):
                    if not torch.allclose(u.float(), v.float(), atol=tol, rtol=tol):
                        raise SystemExit(f"{model} {group} x{rows}: the joined GEMM's outputs differ")
                if device.type == "cuda":
                    t_apart, t_joined = C.graph_time_us(apart), C.graph_time_us(joined)
                else:
                    t_apart, t_joined = C.time_us(C.rotate(apart), device), C.time_us(C.rotate(joined), device)
                key = f"{model}:{group}:{rows}"
                results[key] = dict(apart_us=t_apart, joined_us=t_joined, weight_bytes=nbytes)
                table.append([model, group, str(rows), f"{t_apart:.1f}", f"{t_joined:.1f}", f"{t_apart / t_joined:.2f}x",
                              f"{nbytes / t_joined / 1e3:.0f}"])
    print(C.gpu_name(device) if device.type == "cuda" else "cpu (a smoke run)")
    md = C.md_table(["model", "group", "rows", "apart (us)", "joined (us)", "speed-up", "joined GB/s"], table)
    print(md)
    if not a.quick:
        C.save_results(device, BENCH, results, f"## Decode projections apart vs joined ({C.gpu_name(device)}, "
                       f"{C.now()})\n\nus per layer's group in CUDA graphs, {LAYERS} layers' weights rotated, the "
                       f"same outputs checked first.\n\n{md}\n", a.out, a.md)


if __name__ == "__main__":
    main()
