"""The engine's sampler by sampling mode (``integration/sampler.py``): what a step's draw costs with
the default settings (temperature alone: one pass) and with each filter, greedy rows or top
log-probabilities, from bf16 logits. Eager (``Sampler.__call__``: the noise keys uploaded, each op
launched from the host; the settings' device copies kept, as for the steps of one decode batch) and, on a GPU, the draw alone replayed from a CUDA graph
(``Sampler.sample``, as the engine's decode graphs hold it); the graph's tokens are checked against
the eager call's first. (The sorted rows that top-k and top-p read before: run this script of an
earlier commit in the same session for the A/B, as benchmarks/results/h200.md's table says.)

    python3 benchmarks/bench_sampler.py [--quick] [--out R.json] [--md R.md]

Rows x vocabulary: 64 x 49152 (SmolLM2), 64 x 128256 (Llama 3). us per draw.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from paged_backend.integration.sampler import SampleRows, Sampler, row_keys  # noqa: E402

BENCH = "sampler"
CASES = [(64, 49152), (64, 128256)]
# mode name -> the rows' settings besides temperature 1
MODES = {"temperature": {}, "greedy": dict(temperature=0.0), "top-k 50": dict(top_k=50), "top-p 0.9": dict(top_p=0.9),
         "top-p 0.95": dict(top_p=0.95), "top-k 50 + top-p 0.9": dict(top_k=50, top_p=0.9), "min-p 0.05": dict(min_p=0.05),
         "min-p 0.05 + top-p 0.9": dict(min_p=0.05, top_p=0.9),
         "5 top log-probs": dict(num_logprobs=5)}


def rows_of(s: int, settings: dict) -> SampleRows:
    full = lambda key, default, dtype: np.full(s, settings.get(key, default), dtype)  # noqa: E731
    return SampleRows(full("temperature", 1.0, np.float32), full("top_k", -1, np.int64), full("top_p", 1.0, np.float32),
                      full("min_p", 0.0, np.float32), row_keys(np.arange(s), np.zeros(s), np.full(s, 3)),
                      settings.get("num_logprobs", 0))


def main() -> None:
    p = C.parser(__doc__)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, results = [], {}
    for s, v in ([(4, 1000)] if a.quick else CASES):
        g = torch.Generator(device=device).manual_seed(0)
        logits = (3 * torch.randn(s, v, device=device, generator=g)).to(torch.bfloat16)
        sampler = Sampler(v, device)
        for name, settings in MODES.items():
            r = rows_of(s, settings)
            want = sampler(logits, r)
            eager = C.time_us(lambda: sampler(logits, r), device)
            st = sampler.settings(r)
            args = [torch.from_numpy(x).to(device) for x in (st.k, st.temp, st.min_p, st.top_p, st.greedy)]
            key = torch.from_numpy(r.key.astype(np.int64)).to(device)
            if not torch.equal(sampler.sample(logits, st.mode, *args, key).tokens, want.tokens):
                raise SystemExit(f"{s} x {v}, {name}: Sampler.sample drew other tokens than the sampler")
            graph = C.graph_time_us([lambda: sampler.sample(logits, st.mode, *args, key)]) if device.type == "cuda" else None
            rows.append([f"{s} x {v}", name, f"{eager:.1f}", "" if graph is None else f"{graph:.1f}"])
            results[f"{s}x{v}:{name}"] = dict(eager_us=eager, graph_us=graph)
    print(C.gpu_name(device) if device.type == "cuda" else "cpu (a smoke run)")
    table = C.md_table(["rows x vocabulary", "settings", "eager (us)", "in a CUDA graph (us)"], rows)
    print(table)
    if not a.quick:
        C.save_results(device, BENCH, results, f"## Sampler by mode ({C.gpu_name(device)}, {C.now()})\n\nus per draw "
                       f"from bf16 logits, temperature 1 besides the settings named; the graph's tokens checked "
                       f"against the eager call's first.\n\n{table}\n", a.out, a.md)


if __name__ == "__main__":
    main()
