"""Top-p floors (``paged_backend.top_p``): the Triton search (``kernels/top_p.py``) against the sorted
fp64 torch version, the same floors checked first; us per call in a CUDA graph, on rows shaped like
a language model's at temperature 1 with top_p 0.9 (half the rows with a top-k 50 floor too).
``--sweep`` also times the kernel's values a program reads at once (BLOCK), warps per program and cuts
per pass (NC: fewer cuts, more passes over the rows).

    python3 benchmarks/bench_top_p.py [--quick] [--sweep] [--out R.json] [--md R.md]

Rows x vocabulary: 64 x 49152 (SmolLM2), 64 x 128256 (Llama 3), 256 x 128256, 1 x 128256.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import paged_backend.kernels.top_p as K  # noqa: E402
from paged_backend.top_p import top_p_floor, top_p_floor_torch  # noqa: E402

BENCH = "top_p"
CASES = [(64, 49152), (64, 128256), (256, 128256), (1, 128256)]
SWEEP = [(256, 4, 16), (128, 4, 16), (512, 4, 16), (256, 8, 16), (512, 8, 16), (256, 4, 8), (512, 4, 8),
         (256, 4, 4), (512, 4, 4), (256, 4, 32)]  # (BLOCK, NUM_WARPS, NC)


def rows_like_a_model(s: int, v: int, device) -> torch.Tensor:
    """A long tail and a few tokens far above it, bf16-rounded logits (temperature 1)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s, v, device=device, generator=g) * 2.0
    top = torch.randint(0, v, (s, 8), device=device, generator=g)
    x.scatter_(1, top, 8.0 + 4.0 * torch.rand(s, 8, device=device, generator=g))
    return x.bfloat16().float()


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--sweep", action="store_true", help="time the kernel's BLOCK x NUM_WARPS too")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, results = [], {}
    for s, v in ([(4, 1000)] if a.quick else CASES):
        x = rows_like_a_model(s, v, device)
        kth = torch.topk(x, 50, dim=-1).values[:, -1]
        floor = torch.where(torch.arange(s, device=device) % 2 == 0, kth, float("-inf"))
        top_p = torch.full((s,), 0.9, device=device)
        want = top_p_floor_torch(x, floor, top_p)
        if not torch.equal(top_p_floor(x, floor, top_p), want):
            raise SystemExit(f"{s} x {v}: the search's floors differ from the sorted version's")
        if device.type != "cuda":
            rows.append([f"{s} x {v}", "", "", "", ""])
            continue
        sort_us = C.graph_time_us([lambda: top_p_floor_torch(x, floor, top_p)])
        default = (K.BLOCK, K.NUM_WARPS, K.NC)
        for block, warps, nc in SWEEP if a.sweep else [default]:
            K.BLOCK, K.NUM_WARPS, K.NC = block, warps, nc
            if not torch.equal(top_p_floor(x, floor, top_p), want):
                raise SystemExit(f"{s} x {v}, BLOCK {block}, {warps} warps, NC {nc}: other floors")
            us = C.graph_time_us([lambda: top_p_floor(x, floor, top_p)])
            tag = f"{block} x {warps} x {nc}" + (" (default)" if (block, warps, nc) == default else "")
            rows.append([f"{s} x {v}", tag, f"{sort_us:.1f}", f"{us:.1f}", f"{sort_us / us:.2f}x"])
            results[f"{s}x{v}:{block}x{warps}x{nc}"] = dict(sorted_us=sort_us, search_us=us)
        K.BLOCK, K.NUM_WARPS, K.NC = default
    print(C.gpu_name(device) if device.type == "cuda" else "cpu (a smoke run: floors checked, nothing timed)")
    table = C.md_table(["rows x vocabulary", "BLOCK x warps x NC", "sorted fp64 (us)", "search (us)", "speed-up"], rows)
    print(table)
    if not a.quick and device.type == "cuda":
        C.save_results(device, BENCH, results, f"## Top-p floors ({C.gpu_name(device)}, {C.now()})\n\nus per call "
                       f"in a CUDA graph, top_p 0.9 on rows shaped like a model's (every other row with a top-k 50 "
                       f"floor); the search's floors checked against the sorted version's first.\n\n{table}\n",
                       a.out, a.md)


if __name__ == "__main__":
    main()
