"""Paged decode benchmark: ours (stream-K, split-KV, no plan, stream-K in a CUDA graph) against
FlashInfer, torch SDPA (flash, dense KV) and xformers triton_splitk, in one process.

    python3 benchmarks/bench_decode.py [--cases B1x32K,ragged16] [--out R.json] [--md R.md]
    TRITON_INTERPRET=1 python3 benchmarks/bench_decode.py --quick    # CPU smoke run, peers skipped

See benchmarks/README.md for the columns. Any failure (ours or a peer) is recorded, never fatal.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402  (also puts the repo root on sys.path)
import paged_backend as pb  # noqa: E402
from peers import PEERS, Impl, Skip  # noqa: E402

K = 1024
BENCH = "decode"
OURS = ("ours_sk", "ours_portable", "ours_split", "ours_noplan")
IMPLS = OURS + tuple(PEERS)
# also timed as CUDA-graph replays: "<name>@graph"
GRAPHED = ("ours_sk", "ours_portable", "flashinfer", "sdpa", "xformers")
REL_TOL, LSE_TOL, PEER_LSE_TOL = 1e-2, 1e-3, 1e-2

# name -> (lengths, Hq, Hkv); workload of record first, then the stream-K issue's cases
CASES = {
    "B1x32K": ([32 * K], 32, 8),
    "B1x128K": ([128 * K], 32, 8),
    "B8x32K": ([32 * K] * 8, 32, 8),
    "B64x4K": ([4 * K] * 64, 32, 8),
    "ragged16": ([128 * K] + [K] * 15, 32, 8),
    "B1x8K": ([8 * K], 32, 8),
    "B1x512K": ([512 * K], 32, 8),
    "MQA_B4x64K": ([64 * K] * 4, 32, 1),
    "ragged64": ([256 * K] + [2 * K] * 63, 32, 8),
    "rand16": (np.random.default_rng(2026).integers(K, 128 * K + 1, 16).tolist(), 32, 8),
    # sliding window 4096 (issue #20): time should follow the window, not the 128K context
    "W4K_B1x128K": ([128 * K], 32, 8, 4 * K),
    "W4K_B8x128K": ([128 * K] * 8, 32, 8, 4 * K),
    # fp8 e4m3 KV (issue #20), bf16 queries: bytes and GB/s count one byte per K/V element
    "FP8_B8x32K": ([32 * K] * 8, 32, 8, None, torch.float8_e4m3fn),
    "FP8_B64x4K": ([4 * K] * 64, 32, 8, None, torch.float8_e4m3fn),
    "FP8_ragged16": ([128 * K] + [K] * 15, 32, 8, None, torch.float8_e4m3fn),
    "FP8_B1x128K": ([128 * K], 32, 8, None, torch.float8_e4m3fn),
}
QUICK_CASES = {
    "B1x200": ([200], 32, 8),
    "B3x130": ([130] * 3, 32, 8),
    "ragged4": ([300, 17, 64, 1], 32, 8),
    "MQA_B2x96": ([96] * 2, 32, 1),
    "W40_B2x200": ([200, 30], 32, 8, 40),
    "FP8_B3x130": ([130] * 3, 32, 8, None, torch.float8_e4m3fn),
}
HEAD_DIM, BLOCK_SIZE = 128, 16


def ours_impl(inp: C.PagedInputs, kind: str) -> Impl:
    bt, sl = inp.block_table, inp.seq_lens
    if kind == "ours_noplan":
        plan = None
    else:
        plan = pb.plan_decode(np.asarray(inp.lens), num_q_heads=inp.num_q_heads, num_kv_heads=inp.num_kv_heads,
                              head_dim=inp.head_dim, block_size=inp.block_size, device=inp.device,
                              mode="split" if kind == "ours_split" else "stream_k", window=inp.window,
                              kv_dtype=inp.kv_dtype)
    fns = [lambda q=q, k=k, v=v: pb.paged_decode(q, k, v, bt, sl, plan=plan, window=inp.window)
           for q, k, v in inp.sets]
    if kind == "ours_portable":  # the stream-K plan on the portable kernels: its launches bound with the
        with mock.patch.dict(os.environ, PAGED_BACKEND_SM90="0"):  # Hopper kernels off (the plan keeps them)
            fns[0]()
    note = "" if plan is None else f"G={plan.num_programs} pieces={plan.num_pieces}"
    return Impl(fns, fns[0], note)


def make_impl(name: str, inp: C.PagedInputs) -> Impl:
    return ours_impl(inp, name) if name in OURS else PEERS[name](inp)


def _ratios(rec: dict) -> None:
    """Eager vs FlashInfer eager, graph vs FlashInfer graph (FlashInfer time / this time)."""
    for name, r in rec["impls"].items():
        fi = rec["impls"].get("flashinfer@graph" if name.endswith("@graph") else "flashinfer", {}).get("us")
        if fi and r.get("us"):
            r["x_vs_flashinfer"] = fi / r["us"]
    if "lse_vs_ours" in rec["impls"].get("flashinfer", {}) and "ours_sk" in rec["impls"]:
        rec["impls"]["ours_sk"]["lse_vs_flashinfer"] = rec["impls"]["flashinfer"]["lse_vs_ours"]


def run_case(name, lens, hq, hkv, args, copy_gbps, window=None, kv_dtype=None) -> dict:
    dev, dtype = torch.device(args.device), args.dtype
    if kv_dtype is not None and dev.type != "cuda":
        dtype = torch.float16  # (the interpreter's fp8 path: fp16 queries)
    inp = C.make_paged_inputs(lens, hq, hkv, HEAD_DIM, BLOCK_SIZE, dtype, dev, seed=sum(map(ord, name)),
                              window=window, kv_dtype=kv_dtype)
    rows = C.check_rows(lens)
    ref_o, ref_lse = C.reference(inp, rows)
    rec = {"all_lens": lens, "window": window, "kv_dtype": str(kv_dtype).replace("torch.", "") if kv_dtype else None,
           "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
           "dtype": str(dtype).replace("torch.", ""), "bytes": inp.kv_bytes, "input_sets": len(inp.sets),
           "checked_rows": rows, "impls": {}}
    print(f"\n== {name}: B={len(lens)} sum_len={sum(lens)} Hq={hq} Hkv={hkv} "
          f"KV {inp.kv_bytes / C.MB:.1f} MB, {len(inp.sets)} input set(s)", flush=True)
    ours_lse = None
    for impl_name in args.impls:
        r, impl = {}, None
        try:
            impl = make_impl(impl_name, inp)
            o, lse = impl.result()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            r["note"] = impl.note
            r["rel_err"] = C.rel_err(o[rows], ref_o)
            if lse is not None:
                r["lse_err"] = (lse[rows].double() - ref_lse).abs().max().item()
                if impl_name == "ours_sk":
                    ours_lse = lse.double()
                elif impl_name == "flashinfer" and ours_lse is not None:
                    r["lse_vs_ours"] = (lse.double() - ours_lse).abs().max().item()
            lse_tol = LSE_TOL if impl_name in OURS else PEER_LSE_TOL
            r["ok"] = bool(torch.isfinite(o).all().item()) and r["rel_err"] <= REL_TOL \
                and r.get("lse_err", 0.0) <= lse_tol
            del o, lse
            us = C.time_us(C.rotate(impl.fns), dev, args.warmup_ms, args.rep_ms)
            r.update(us=us, gbps=inp.kv_bytes / (us * 1e-6) / 1e9)
            r["pct_copy"] = 100 * r["gbps"] / copy_gbps if copy_gbps else None
            if dev.type == "cuda" and impl_name in GRAPHED and not args.no_graph:
                try:
                    gus = C.graph_time_us(impl.fns, args.warmup_ms, args.rep_ms)
                    rec["impls"][impl_name + "@graph"] = dict(
                        us=gus, gbps=inp.kv_bytes / (gus * 1e-6) / 1e9, ok=r["ok"], note="cuda graph replay",
                        rel_err=r["rel_err"], pct_copy=100 * inp.kv_bytes / (gus * 1e-6) / 1e9 / copy_gbps)
                except Exception as e:  # graph capture is a bonus measurement, never fatal
                    rec["impls"][impl_name + "@graph"] = {"error": C.short_error(e)}
        except Skip as e:
            r = {"skipped": str(e)}
        except Exception as e:  # a failure of one implementation never stops the run
            r["error"] = C.short_error(e)
            traceback.print_exc(limit=-4)
        impl = None  # drop its buffers before the next implementation
        rec["impls"][impl_name] = r
        print(f"  {impl_name:14s} {cell(r, None):>22s}  {detail(r)}", flush=True)
        C.free_memory()
    _ratios(rec)
    del inp, ref_o, ref_lse
    C.free_memory()
    return rec


def run_isolated(name: str, argv, copy_gbps: float, impls) -> dict:
    """Runs one case in a fresh process (same flags) and returns its record. If the process dies (a
    peer's kernel may crash it: FlashInfer's MQA tensor-core decode did), the case is run again
    with ours, then each peer in a process of its own, so a crash loses only that peer's cells."""
    keep = list(argv if argv is not None else sys.argv[1:])
    for flag in ("--cases", "--impls"):
        if flag in keep:
            i = keep.index(flag)
            del keep[i:i + 2]

    def attempt(names):  # -> (record or None, exit code)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "case.json")
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *keep, "--cases", name,
                                   "--impls", ",".join(names), "--child", path, "--copy-gbps", str(copy_gbps)])
            if not os.path.exists(path):  # only a finished case leaves a file
                return None, proc.returncode
            with open(path) as f:
                return json.load(f), 0

    rec, _ = attempt(impls)
    if rec is not None:
        return rec
    ours = [i for i in impls if i in OURS]
    rec, code = attempt(ours)
    if rec is None:
        raise RuntimeError(f"case process died (exit code {code})")
    for peer in (i for i in impls if i not in OURS):
        one, code = attempt([peer])
        for key, r in (one or {}).get("impls", {}).items():
            rec["impls"][key] = r
        if one is None:
            rec["impls"][peer] = {"error": f"not measured: its process died (exit code {code})"}
    _ratios(rec)
    return rec


def cell(r: dict, fi_us, long: bool = False) -> str:
    if "us" not in r:
        return "skip" if "skipped" in r else "ERROR"
    s = f"{r['us']:8.1f}us"
    if long:
        s += f" {r['gbps']:.0f}GB/s"
    if r.get("pct_copy") is not None:
        s += f" {r['pct_copy']:3.0f}%"
    if fi_us:
        s += f" {fi_us / r['us']:4.2f}x"
    return s + ("" if r.get("ok", True) else " WRONG")


def detail(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "error" in r:
        return r["error"]
    parts = [f"rel_err={r['rel_err']:.2e}"]
    if "lse_err" in r:
        parts.append(f"lse_err={r['lse_err']:.1e}")
    if "lse_vs_ours" in r:
        parts.append(f"lse_vs_ours={r['lse_vs_ours']:.1e}")
    return " ".join(parts + [r.get("note", "")])


def plan_times(args) -> dict:
    out = {}
    rng = np.random.default_rng(7)
    for b in (1, 256, 4096):
        lens = rng.integers(3 * K, 5 * K + 1, b)
        kw = dict(num_q_heads=32, num_kv_heads=8, head_dim=HEAD_DIM, block_size=BLOCK_SIZE, device=args.device)
        try:
            calls = 200 if b < 4096 else 50
            new = C.host_time_us(lambda: pb.plan_decode(lens, **kw), calls)
            plan = pb.plan_decode(lens, **kw)
            step = itertools.count(1)
            # a decode step: every request grows by one token (the incremental path unless a
            # request crosses a tile boundary), and a full re-partition (every tile count changes)
            upd = C.host_time_us(lambda: plan.update(lens + next(step)), calls)
            full = C.host_time_us(lambda: plan.update(lens + plan.block_n * (next(step) % 2)), calls)
            out[f"B{b}"] = {"plan_decode_us": new, "update_us": upd, "repartition_us": full}
        except Exception as e:
            out[f"B{b}"] = {"error": C.short_error(e)}
    return out


def _lens_str(rec) -> str:
    lens = rec["all_lens"]
    if len(set(lens)) == 1:
        return f"{len(lens)}x{lens[0]}"
    return "+".join(str(n) for n in lens) if len(lens) <= 16 else f"1x{max(lens)}+{len(lens) - 1}x{min(lens)}"


def render(results: dict, names) -> tuple[str, str]:
    """-> (console table, markdown section)."""
    impls = [i for i in IMPLS + tuple(g + "@graph" for g in GRAPHED)
             if any(i in results["cases"][c]["impls"] for c in names)]
    head = ["case", "KV MB"] + impls + ["check"]
    rows, md_rows = [], []
    for c in names:
        rec = results["cases"][c]
        fi = rec["impls"].get("flashinfer", {}).get("us")
        fi_graph = rec["impls"].get("flashinfer@graph", {}).get("us")
        bad = [i for i, r in rec["impls"].items() if r.get("ok") is False]
        err = [i for i, r in rec["impls"].items() if "error" in r]
        check = " ".join(([f"WRONG:{','.join(bad)}"] if bad else []) + ([f"error:{','.join(err)}"] if err else []))
        mb = rec["bytes"] / C.MB
        for out, long in ((rows, False), (md_rows, True)):
            cells = [" ".join(cell(rec["impls"].get(i, {"skipped": ""}), fi_graph if i.endswith("@graph") else fi,
                                   long).split()) for i in impls]
            out.append([c, f"{mb:.0f}" if mb >= 10 else f"{mb:.1f}"] + cells + [check or "ok"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: " | ".join(str(x).rjust(w) if j else str(x).ljust(w) for j, (x, w) in enumerate(zip(r, widths)))
    console = "\n".join([fmt(head), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in rows])
    pt = results.get("plan_time_us", {})
    plan_rows = [[k, f"{v['plan_decode_us']:.0f}" if "plan_decode_us" in v else v.get("error", ""),
                  f"{v['update_us']:.0f}" if "update_us" in v else "",
                  f"{v['repartition_us']:.0f}" if "repartition_us" in v else ""] for k, v in pt.items()]
    md = [f"## Paged decode ({results['device']}, {results['date']})", "",
          f"Copy bandwidth measured in the same run: **{results['copy_gbps']:.0f} GB/s** (read + write). "
          f"bf16 (fp32 on CPU), D={HEAD_DIM}, page {BLOCK_SIZE}, pages shuffled. Cells: median time, KV GB/s, "
          f"% of copy bandwidth, FlashInfer time / this time (>1 = faster than FlashInfer). "
          f"Versions: {results['versions']}.", "", C.md_table(head, md_rows), "",
          "Host planning time (`plan_decode` new; `plan.update` for a decode step and for a full "
          "re-partition), lengths ~4K, us:", "",
          C.md_table(["batch", "plan_decode", "update (decode step)", "update (all tiles change)"], plan_rows)]
    md += ["", "Cases (lengths, Hq/Hkv): " + "; ".join(
        f"{c}: {_lens_str(results['cases'][c])}, {results['cases'][c]['num_q_heads']}/"
        f"{results['cases'][c]['num_kv_heads']}" for c in names)]
    notes = [f"- {c}: {results['cases'][c]['note']}" for c in names if results["cases"][c].get("note")]
    if notes:  # a row from another run, say
        md += ["", "Notes:", ""] + notes
    errs = [f"- {c} / {i}: {r['error']}" for c in names for i, r in results["cases"][c]["impls"].items()
            if "error" in r]
    if errs:
        md += ["", "Errors:", ""] + errs
    return console, "\n".join(md)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    p.add_argument("--impls", help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timings")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--out", help="results JSON (merged by benchmark name); default "
                                 "benchmarks/results/<gpu>.json, none with --quick")
    p.add_argument("--md", help="markdown file (section replaced); default benchmarks/results/<gpu>.md, "
                                "none with --quick")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup-ms", type=int, default=50)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--no-isolate", action="store_true",
                   help="run all cases in this process (default on CUDA: one subprocess per case, so a "
                        "peer that crashes the process loses only its case)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: write one case's record here
    p.add_argument("--copy-gbps", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    args.device = dev
    # The Triton interpreter cannot do bf16 arithmetic: fp32 on the CPU.
    args.dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    table = QUICK_CASES if args.quick else CASES
    names = args.cases.split(",") if args.cases else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {list(table)}")
    args.impls = args.impls.split(",") if args.impls else list(IMPLS)
    for mod in ("flashinfer", "xformers"):  # import peers up front so versions are recorded
        if dev.type == "cuda" and mod in args.impls:
            try:
                __import__(mod)
            except Exception as e:
                print(f"[peer] {mod} unavailable: {C.short_error(e)}", flush=True)
    slug = C.gpu_slug(dev)
    out = args.out or (None if args.quick else os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.json"))
    md = args.md or (None if args.quick else os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.md"))
    copy_gbps = args.copy_gbps or C.copy_bandwidth(dev)
    if args.child:
        rec = run_case(names[0], *table[names[0]][:3], args, copy_gbps, *table[names[0]][3:])
        with open(args.child, "w") as f:  # only a finished case leaves a file
            json.dump(rec, f)
        return 0
    isolate = dev.type == "cuda" and not args.no_isolate
    results = {"device": C.gpu_name(dev), "date": C.now(), "copy_gbps": copy_gbps, "versions": C.versions(),
               "quick": args.quick, "cases": {}}
    print(f"device {results['device']}  copy {copy_gbps:.0f} GB/s  {results['versions']}", flush=True)
    done = []
    for n in names:
        try:
            if isolate:
                results["cases"][n] = run_isolated(n, argv, copy_gbps, args.impls)
            else:
                results["cases"][n] = run_case(n, *table[n][:3], args, copy_gbps, *table[n][3:])
            done.append(n)
        except Exception as e:  # input creation or reference failed (e.g. out of memory)
            print(f"case {n} failed: {C.short_error(e)}", flush=True)
            traceback.print_exc(limit=-4)
            C.free_memory()
        results["versions"] = C.versions()
        if out:
            C.write_json(out, BENCH, results)  # after every case: a time-out keeps what was done
    results["plan_time_us"] = plan_times(args)
    console, section = render(results, done)
    if out:
        C.write_json(out, BENCH, results)
        print(f"\nwrote {out}")
    if md:
        C.write_md_section(md, BENCH, section)
        print(f"wrote {md}")
    print("\nplan time (us, host):", ", ".join(
        f"{k}: new {v.get('plan_decode_us', float('nan')):.0f} / step {v.get('update_us', float('nan')):.0f}"
        f" / re-partition {v.get('repartition_us', float('nan')):.0f}"
        for k, v in results["plan_time_us"].items()))
    print(f"\nPaged decode, {results['device']}, copy {copy_gbps:.0f} GB/s; cell = median us, % of copy "
          f"bandwidth, x = FlashInfer time / this time")
    print(console, flush=True)
    return 0 if all(n in done for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
