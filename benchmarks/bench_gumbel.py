"""The engine's Gumbel-max draw: the fused kernel (``kernels/gumbel.py``) against the torch ops it
replaced (``paged_backend.gumbel.gumbel_argmax_torch``), same inputs, same tokens checked first; and
the engine's whole draw of temperature-only rows from bf16 logits (``gumbel_sample``: one pass, the
log-probability too) against the four passes it replaced (fp32 copy, log-sum-exp, / T, the draw).

    python3 benchmarks/bench_gumbel.py [--quick] [--out R.json] [--md R.md]

Rows x vocabulary: 64 x 128256 (Llama 3), 64 x 49152 (SmolLM2), 256 x 128256. us per draw.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from paged_backend.gumbel import gumbel_argmax, gumbel_argmax_torch, gumbel_sample, vocab_hash  # noqa: E402

BENCH = "sample"
CASES = [(64, 128256), (64, 49152), (256, 128256)]


def main() -> None:
    p = C.parser(__doc__)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, results = [], {}
    for s, v in ([(4, 1000)] if a.quick else CASES):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(s, v, device=device, generator=g)
        keys = torch.randint(0, 2 ** 32, (s,), device=device, dtype=torch.int64, generator=g)
        vh = vocab_hash(v, device)
        if not torch.equal(gumbel_argmax(x, keys, vh), gumbel_argmax_torch(x, keys, vh)):
            raise SystemExit(f"{s} x {v}: the fused draw picked other tokens than the torch ops")
        t_torch = C.time_us(lambda: gumbel_argmax_torch(x, keys, vh), device)
        t_fused = C.time_us(lambda: gumbel_argmax(x, keys, vh), device)
        logits = x.to(torch.bfloat16)
        temp = torch.linspace(0.5, 1.5, s, device=device)

        def four_passes():  # the sampler's steps before gumbel_sample
            xf = logits.float()
            lse = torch.logsumexp(xf, dim=-1)
            tok = gumbel_argmax(xf / temp[:, None], keys, vh)
            return tok, xf.gather(1, tok[:, None])[:, 0] - lse

        (t4, l4), (t1, l1) = four_passes(), gumbel_sample(logits, temp, keys, vh)
        if not (torch.equal(t4, t1) and torch.allclose(l4, l1, atol=1e-4)):
            raise SystemExit(f"{s} x {v}: the one-pass sample differs from the four passes")
        t_four = C.time_us(four_passes, device)
        t_one = C.time_us(lambda: gumbel_sample(logits, temp, keys, vh), device)
        rows.append([f"{s} x {v}", f"{t_torch:.1f}", f"{t_fused:.1f}", f"{t_torch / t_fused:.1f}x", f"{t_four:.1f}",
                     f"{t_one:.1f}", f"{t_four / t_one:.1f}x"])
        results[f"{s}x{v}"] = dict(torch_us=t_torch, fused_us=t_fused, same_tokens=True, sample_four_passes_us=t_four,
                                   sample_one_pass_us=t_one)
    print(C.gpu_name(device) if device.type == "cuda" else "cpu (both are torch ops there: a smoke run)")
    table = C.md_table(["rows x vocabulary", "draw: torch ops (us)", "fused (us)", "speed-up",
                        "sample bf16: four passes (us)", "one pass (us)", "speed-up"], rows)
    print(table)
    if not a.quick:
        C.save_results(device, BENCH, results, f"## Sampling draw ({C.gpu_name(device)}, {C.now()})\n\nus per draw, the "
                       f"same tokens checked first (the sample: with each token's log-probability, temperatures "
                       f"0.5-1.5).\n\n{table}\n", a.out, a.md)


if __name__ == "__main__":
    main()
