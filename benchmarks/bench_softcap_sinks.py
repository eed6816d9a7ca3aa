"""What logit soft-capping and attention sinks cost: decode (CUDA graphs, as an engine replays a
step) and paged prefill with each feature against the same call without it, in one process.

    python3 benchmarks/bench_softcap_sinks.py [--out R.json] [--md R.md]

bf16, Hq 32, Hkv 8, D 128, page 16, softcap 30 (Gemma 2's 50 would rarely cap), sinks [Hq]; the
"fp8" decode cases read an e4m3 cache (bf16 queries, scales 1.0).
Target (issue #20): each feature <= 3% over plain decode. Prefill is reported too (the cap's
tanh is in the score tile of a compute-bound kernel).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import paged_backend as pb  # noqa: E402

BENCH = "softcap_sinks"
K = 1024
HQ, HKV, D, BS = 32, 8, 128, 16
DECODE = {"B8x32K": [32 * K] * 8, "B64x4K": [4 * K] * 64, "ragged16": [128 * K] + [K] * 15, "B1x8K": [8 * K],
          "fp8 B8x32K": [32 * K] * 8, "fp8 ragged16": [128 * K] + [K] * 15}
PREFILL = {"1x8K": ([8 * K], [8 * K]), "2K chunk over 30K": ([2 * K], [32 * K])}
FEATURES = {"plain": {}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": True},
            "both": {"softcap": 30.0, "sinks": True}}


def kwargs(feature: str, device) -> dict:
    kw = dict(FEATURES[feature])
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1.0, 4.0, HQ, device=device)
    return kw


def decode_rows(device) -> list[dict]:
    rows = []
    for name, lens in DECODE.items():
        kv_dtype = torch.float8_e4m3fn if name.startswith("fp8") else None
        inp = C.make_paged_inputs(lens, HQ, HKV, D, BS, torch.bfloat16, device, kv_dtype=kv_dtype)
        plan = pb.plan_decode(np.asarray(lens), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                              device=device, kv_dtype=kv_dtype)
        row = {"op": "decode", "case": name}
        for feature in FEATURES:
            kw = kwargs(feature, device)
            fns = [lambda q=q, k=k, v=v: pb.paged_decode(q, k, v, inp.block_table, inp.seq_lens, plan=plan, **kw)
                   for q, k, v in inp.sets]
            row[feature] = C.graph_time_us(fns)
        rows.append(row)
        del inp
        C.free_memory()
    return rows


def prefill_rows(device) -> list[dict]:
    rows = []
    for name, (q_lens, seq_lens) in PREFILL.items():
        need = [-(-n // BS) for n in seq_lens]
        k = torch.randn(sum(need) + 1, BS, HKV, D, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.arange(sum(need), dtype=torch.int32, device=device).view(len(need), -1)
        q = torch.randn(sum(q_lens), HQ, D, device=device, dtype=torch.bfloat16)
        qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        row = {"op": "prefill", "case": name}
        for feature in FEATURES:
            kw = kwargs(feature, device)
            row[feature] = C.time_us(lambda kw=kw: pb.paged_prefill(q, k, v, table, sl, qsl, **kw), device)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    slug = C.gpu_slug()
    ap.add_argument("--out", default=os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.json"))
    ap.add_argument("--md", default=os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.md"))
    args = ap.parse_args()
    rows = decode_rows("cuda") + prefill_rows("cuda")
    for r in rows:
        for f in ("softcap", "sinks", "both"):
            r[f"{f}_overhead_pct"] = 100.0 * (r[f] / r["plain"] - 1.0)
        print(r, flush=True)
    C.write_json(args.out, BENCH, {"when": C.now(), "gpu": C.gpu_name(), "versions": C.versions(), "rows": rows})
    table = C.md_table(["op", "case", "plain us", "softcap us (+%)", "sinks us (+%)", "both us (+%)"],
                       [[r["op"], r["case"], f"{r['plain']:.1f}"]
                        + [f"{r[f]:.1f} ({r[f + '_overhead_pct']:+.1f}%)" for f in ("softcap", "sinks", "both")]
                        for r in rows])
    text = (f"## Soft-capping and sinks: cost over plain attention ({C.gpu_name()}, {C.now()})\n\n"
            f"bf16 (fp8 rows: an e4m3 cache), Hq {HQ}, Hkv {HKV}, D {D}, page {BS}; decode in CUDA graphs, "
            f"prefill eager.\n\n{table}\n")
    C.write_md_section(args.md, BENCH, text)
    print(text)


if __name__ == "__main__":
    main()
