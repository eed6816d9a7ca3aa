"""Cascade (shared-prefix) decode benchmark: ours against FlashInfer MultiLevelCascade, FlashInfer
flat decode and our own flat (stream-K) decode, in one process, on the same paged cache.

    python3 benchmarks/bench_cascade.py [--cases 8192/64/256,...] [--out R.json] [--md R.md]
    TRITON_INTERPRET=1 python3 benchmarks/bench_cascade.py --quick   # CPU smoke run, peers skipped

Cases are prefix/n/suffix (n samples share a prefix, each has its own suffix) plus ``2level``: a
2048-token system prompt shared by 32 prompts of 4096 tokens x 8 samples with 256-token tails.
bf16, Hq 32, Hkv 8, D 128, page 16, pages shuffled. ``floor%`` = unique KV bytes (each shared
prefix once + the suffixes) / time, as % of the copy bandwidth measured in the same run.
Also times ``plan_cascade`` on 1024 requests x 2K blocks (host, target < 1 ms), new, with the
forest of the previous step reused (``forest=``), and with it restricted to the requests left after
32 finished (``forest_rows=``).
``--node-programs 66,264`` also times ours with those node grids (plan_cascade's ``node_programs``);
``--node-tiles 128x2`` with the Hopper node kernel's K/V tiles of 128 keys in 2 stages (``NODE_TILE``);
``--fp8-fused-flops inf,0`` with plans of those ``CascadeCost.fp8_fused_flops`` (with ``--kv-dtype fp8``: inf
gives every plan that can take them fused lists, 0 none - the fused-or-not A/B in one process).
Failures (ours or a peer) are recorded, never fatal.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import paged_backend as pb  # noqa: E402
from paged_backend.cascade import CascadeCost, cascade_node_kernel_name  # noqa: E402
from peers import fi_prefill_backend  # noqa: E402

BENCH = "cascade"
HQ, HKV, D, BS = 32, 8, 128, 16
LN2 = float(np.log(2.0))
# name -> levels: list of (tokens per node, fan-out) from the root; the last level is the tails
CASES = {
    "8192/64/256": [(8192, 1), (256, 64)],
    "32768/16/512": [(32768, 1), (512, 16)],
    "4096/256/128": [(4096, 1), (128, 256)],
    "32768/256/256": [(32768, 1), (256, 256)],
    "131072/8/1024": [(131072, 1), (1024, 8)],
    "2level": [(2048, 1), (4096, 32), (256, 8)],
    # the engine's decode steps on the Llama-3-8B shape half way through bench_e2e's runs (64 samples
    # of a 4K prompt, 128 of 256 new tokens; of a 32K prompt, 32 of 64)
    "4096/64/128": [(4096, 1), (128, 64)],
    "32768/64/32": [(32768, 1), (32, 64)],
}
QUICK = {"64/4/16": [(64, 1), (16, 4)], "2level-tiny": [(32, 1), (48, 2), (8, 3)]}


def build(levels, dtype, device, seed=0, n_sets=1, kv_dtype=None):
    """A forest of shared pages: level i has prod(fan-outs[:i+1]) nodes of tokens_i each; every
    request's table row = its ancestors' pages then its own (last level). ``kv_dtype``: a cache
    dtype other than q's (fp8, scales 1.0). -> dict."""
    gen = np.random.default_rng(seed)
    counts = np.cumprod([f for _, f in levels])
    pages_per = [-(-t // BS) for t, _ in levels]
    n_pages = int(sum(c * p for c, p in zip(counts, pages_per)))
    perm = gen.permutation(n_pages).astype(np.int32)
    at, level_pages = 0, []
    for c, p in zip(counts, pages_per):
        level_pages.append(perm[at: at + c * p].reshape(c, p))
        at += c * p
    bsz = int(counts[-1])
    rows = []
    for i in range(len(levels)):  # node of level i for request r: r // (bsz // counts[i])
        rows.append(level_pages[i][np.arange(bsz) // (bsz // counts[i])])
    table = np.concatenate(rows, axis=1)
    lens = np.full(bsz, sum(t for t, _ in levels), dtype=np.int64)
    # the tail's last page may be partial; the shared levels are page aligned here
    shape = (n_pages, BS, HKV, D)
    sets = []
    for s in range(n_sets):
        torch.manual_seed(seed + s)
        kv = kv_dtype or dtype
        sets.append((torch.randn(bsz, HQ, D, device=device).to(dtype), torch.randn(shape, device=device).to(kv),
                     torch.randn(shape, device=device).to(kv)))
    elt = (kv_dtype or dtype).itemsize
    uniq_tokens = sum(int(c) * t for c, (t, _) in zip(counts, levels))
    return dict(table=table, lens=lens, sets=sets, level_pages=level_pages, counts=counts, kv_dtype=kv_dtype or dtype,
                unique_bytes=uniq_tokens * HKV * D * 2 * elt, flat_bytes=int(lens.sum()) * HKV * D * 2 * elt)


def fi_cascade(case, device, dtype):
    import flashinfer
    counts, lp = case["counts"], case["level_pages"]
    bsz = int(counts[-1])
    qo, kvp, kvi, last = [], [], [], []
    for c, pages in zip(counts, lp):
        c = int(c)
        qo.append(torch.arange(c + 1, dtype=torch.int32, device=device) * (bsz // c))
        kvp.append(torch.arange(c + 1, dtype=torch.int32, device=device) * pages.shape[1])
        kvi.append(torch.from_numpy(pages.reshape(-1).copy()).to(device))
        last.append(torch.full((c,), BS, dtype=torch.int32, device=device))
    tail_tokens = int(case["lens"][0]) - sum(p.shape[1] for p in lp[:-1]) * BS
    last[-1].fill_((tail_tokens - 1) % BS + 1)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    w = flashinfer.MultiLevelCascadeAttentionWrapper(len(counts), ws, "NHD")
    backend = fi_prefill_backend("auto", dtype, case["kv_dtype"])
    if backend != "auto":  # (the wrapper takes no backend: its levels' prefill wrappers, made again)
        w._batch_prefill_wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                                     for _ in counts]
    w.plan(qo, kvp, kvi, last, HQ, HKV, D, BS, q_data_type=dtype, kv_data_type=case["kv_dtype"])
    return [lambda q=q, k=k, v=v: w.run(q, (k, v)) for q, k, v in case["sets"]], None


def fi_flat(case, device, dtype):
    import flashinfer
    table, lens = case["table"], case["lens"]
    need = -(-lens // BS)
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(need)]).astype(np.int32)).to(device)
    live = np.arange(table.shape[1])[None, :] < need[:, None]
    indices = torch.from_numpy(table[live].astype(np.int32)).to(device)
    last = torch.from_numpy(((lens - 1) % BS + 1).astype(np.int32)).to(device)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
    w.plan(indptr, indices, last, HQ, HKV, D, BS, q_data_type=dtype, kv_data_type=case["kv_dtype"])
    fns = [lambda q=q, k=k, v=v: w.run(q, (k, v), return_lse=True) for q, k, v in case["sets"]]
    return fns, lambda: (lambda o_l: (o_l[0], o_l[1].float() * LN2))(fns[0]())


def ours_flat(case, device, dtype):
    bt = torch.from_numpy(case["table"]).to(device)
    sl = torch.from_numpy(case["lens"].astype(np.int32)).to(device)
    plan = pb.plan_decode(case["lens"], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, device=device,
                          kv_dtype=case["kv_dtype"])
    fns = [lambda q=q, k=k, v=v: pb.paged_decode(q, k, v, bt, sl, plan=plan) for q, k, v in case["sets"]]
    return fns, fns[0]


def ours_cascade(case, device, dtype, node_programs=None, fp8_fused_flops=None):
    bt_dev = torch.from_numpy(case["table"]).to(device)
    cost = CascadeCost(kv_elem_bytes=case["kv_dtype"].itemsize)  # as the engine plans (fp8: 1-byte reads)
    if fp8_fused_flops is not None:
        cost = dataclasses.replace(cost, fp8_fused_flops=fp8_fused_flops)
    cplan = pb.plan_cascade(case["table"], case["lens"], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                            block_size=BS, device=device, block_table_device=bt_dev, node_programs=node_programs,
                            cost=cost)
    case["cplan"] = cplan
    fns = [lambda q=q, k=k, v=v: pb.cascade_decode(q, k, v, cplan) for q, k, v in case["sets"]]
    return fns, fns[0]


IMPLS = {"ours_cascade": ours_cascade, "ours_flat": ours_flat, "fi_cascade": fi_cascade, "fi_flat": fi_flat}


def plan_timing(quick: bool) -> dict:
    """plan_cascade on 1024 requests x 2K blocks (64 prompts x 16 samples, 1536 shared blocks,
    plus a 128-block system prompt), host only, block table already on the device."""
    bsz, width = (64, 128) if quick else (1024, 2048)
    rng = np.random.default_rng(0)
    table = rng.permutation(4 * bsz * width)[: bsz * width].reshape(bsz, width).astype(np.int32)
    grp = bsz // 64
    for g in range(64):
        table[g * grp:(g + 1) * grp, : width * 3 // 4] = table[g * grp, : width * 3 // 4]
    table[:, : width // 16] = table[0, : width // 16]
    table = np.ascontiguousarray(table[rng.permutation(bsz)])
    lens = np.full(bsz, width * BS - 5)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    bt_dev = torch.from_numpy(table).to(dev)
    kw = dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, device=dev, block_table_device=bt_dev)
    times, reuse = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        cplan = pb.plan_cascade(table, lens, **kw)
        times.append(time.perf_counter() - t0)
    for _ in range(20):  # the next decode step: one more token each, the forest reused
        t0 = time.perf_counter()
        pb.plan_cascade(table, lens + 1, **kw, forest=cplan)
        reuse.append(time.perf_counter() - t0)
    # a step after 32 samples finished: the forest restricted to the requests left (forest_rows)
    rows = np.sort(rng.permutation(bsz)[: bsz - bsz // 32])
    left = np.ascontiguousarray(table[rows])
    kw_left = {**kw, "block_table_device": torch.from_numpy(left).to(dev)}
    removal = []
    for _ in range(20):
        t0 = time.perf_counter()
        pb.plan_cascade(left, lens[rows] + 1, **kw_left, forest=cplan, forest_rows=rows)
        removal.append(time.perf_counter() - t0)
    return {"requests": bsz, "blocks": width, "nodes": cplan.num_nodes, "median_ms": float(np.median(times) * 1e3),
            "min_ms": float(min(times) * 1e3), "reuse_median_ms": float(np.median(reuse) * 1e3),
            "removal_median_ms": float(np.median(removal) * 1e3)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    p.add_argument("--impls", help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--kv-dtype", choices=["fp8"], help="fp8 (e4m3) caches, bf16 queries (floor counts fp8 bytes), "
                   "planned as the engine plans them; results in a section of their own")
    p.add_argument("--node-programs", help="comma-separated node grids to time ours with besides the default "
                                           "(plan_cascade's node_programs: a sweep; rows ours_cascade@N in the JSON)")
    p.add_argument("--node-tiles", help="comma-separated KEYSxSTAGES of the Hopper node kernel's K/V tiles to time ours "
                                        "with besides the default (a sweep; rows ours_cascade#KEYSxSTAGES)")
    p.add_argument("--fp8-fused-flops", help="comma-separated CascadeCost.fp8_fused_flops bounds (inf allowed) to "
                                             "time ours with besides the default (rows ours_cascade~BOUND)")
    p.add_argument("--out", help="results JSON; default benchmarks/results/<gpu>.json, none with --quick")
    p.add_argument("--md", help="markdown; default benchmarks/results/<gpu>.md, none with --quick")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv_dtype = None
    if a.kv_dtype:
        kv_dtype, dtype = torch.float8_e4m3fn, (dtype if device.type == "cuda" else torch.float16)
    cases = QUICK if a.quick else CASES
    if a.cases:
        cases = {k: cases[k] for k in a.cases.split(",")}
    impls = a.impls.split(",") if a.impls else list(IMPLS)
    impls += [f"ours_cascade@{int(n)}" for n in a.node_programs.split(",")] if a.node_programs else []
    impls += [f"ours_cascade#{t}" for t in a.node_tiles.split(",")] if a.node_tiles else []
    impls += [f"ours_cascade~{float(b):g}" for b in a.fp8_fused_flops.split(",")] if a.fp8_fused_flops else []
    if a.node_tiles:
        from paged_backend.kernels import cascade_sm90
        default_tile = cascade_sm90.NODE_TILE
    bw = C.copy_bandwidth(device)
    print(f"{C.gpu_name(device)}  copy bandwidth {bw:.0f} GB/s  {C.versions()}")
    results = {"device": C.gpu_name(device), "copy_GBps": bw, "versions": C.versions(), "cases": {}}
    try:
        results["plan"] = plan_timing(a.quick)
        print(f"plan_cascade {results['plan']}")
    except Exception as e:  # noqa: BLE001
        results["plan"] = {"error": C.short_error(e)}
        traceback.print_exc()
    rows = []
    for name, levels in cases.items():
        C.free_memory()
        res = {}
        try:
            probe = build(levels, dtype, device, n_sets=1, kv_dtype=kv_dtype)
            n_sets = 1
            set_bytes = probe["unique_bytes"]
            if device.type == "cuda" and set_bytes < C.ROTATE_BELOW:
                n_sets = max(1, min(4, int(C.ROTATE_TOTAL // max(set_bytes, 1))))
            case = build(levels, dtype, device, n_sets=n_sets, kv_dtype=kv_dtype) if n_sets > 1 else probe
        except Exception as e:  # noqa: BLE001
            results["cases"][name] = {"error": C.short_error(e)}
            print(name, "build failed:", C.short_error(e))
            continue
        ref = None
        for impl in impls:
            try:
                if impl.startswith("fi_") and device.type != "cuda":
                    res[impl] = {"skipped": "needs CUDA"}
                    continue
                name_, _, grid = impl.partition("@")
                name_, _, tile = name_.partition("#")
                name_, _, bound = name_.partition("~")
                if a.node_tiles:
                    cascade_sm90.NODE_TILE = tuple(map(int, tile.split("x"))) if tile else default_tile
                kw = {"node_programs": int(grid)} if grid else {}
                if bound:
                    kw["fp8_fused_flops"] = float(bound)
                fns, result = IMPLS[name_](case, device, dtype, **kw)
                entry = {}
                if result is not None:
                    o, lse = result()
                    if ref is None:
                        ref = (o.float(), lse.float())
                    else:
                        entry["rel_err_vs_first"] = C.rel_err(o.float(), ref[0])
                        entry["lse_err_vs_first"] = float((lse.float() - ref[1]).abs().max())
                us = C.time_us(C.rotate(fns), device)
                entry.update(us=us, floor_pct=100 * case["unique_bytes"] / (us * 1e-6) / 1e9 / bw)
                if impl.startswith("ours_cascade"):
                    cp = case["cplan"]
                    q, k, v = case["sets"][0]
                    entry.update(nodes=cp.num_nodes, block_m=cp.block_m, flat=cp.is_flat,
                                 node_pieces=cp.num_node_pieces, leaf_pieces=cp.num_leaf_pieces,
                                 node_kernel=cascade_node_kernel_name(q, k, v, cp))
                res[impl] = entry
            except Exception as e:  # noqa: BLE001
                res[impl] = {"error": C.short_error(e)}
                traceback.print_exc()
            C.free_memory()
        ours = res.get("ours_cascade", {}).get("us")
        for other in ("ours_flat", "fi_cascade", "fi_flat"):
            t = res.get(other, {}).get("us")
            if ours and t:
                res[f"speedup_vs_{other}"] = t / ours
        res["unique_MB"] = case["unique_bytes"] / 1e6
        res["flat_MB"] = case["flat_bytes"] / 1e6
        results["cases"][name] = res
        del case, probe

        def cell(impl):
            e = res.get(impl, {})
            if "us" not in e:
                return "err" if "error" in e else "-"
            node = f" ({e['node_kernel']} nodes)" if e.get("node_kernel") and not e.get("flat") else ""
            return f"{e['us']:.1f} us, {e['floor_pct']:.0f}%{node}"
        rows.append([name, cell("ours_cascade"), cell("ours_flat"), cell("fi_cascade"), cell("fi_flat"),
                     *(f"{res[k]:.2f}x" if k in res else "-" for k in
                       ("speedup_vs_ours_flat", "speedup_vs_fi_cascade", "speedup_vs_fi_flat"))])
        print(rows[-1])
        for impl in (i for i in impls if "@" in i or "#" in i or "~" in i):  # the node-grid, tile and bound sweeps
            print(f"  {impl}: {cell(impl)}, {res.get(impl, {}).get('node_pieces')} node pieces")
    table = C.md_table(["prefix/n/suffix", "ours cascade", "ours flat", "FI cascade", "FI flat",
                        "vs ours flat", "vs FI cascade", "vs FI flat"], rows)
    print(table)
    if not a.quick:
        slug = C.gpu_slug(device)
        out = a.out or os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.json")
        md = a.md or os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.md")
        key, title = BENCH, "Cascade decode"
        if a.kv_dtype:  # a section of its own
            key, title = f"{BENCH}:fp8", "Cascade decode over fp8 (e4m3) caches"
        C.write_json(out, key, results)
        plan_line = results.get("plan", {})
        C.write_md_section(md, key, f"## {title} ({C.gpu_name(device)}, {C.now()})\n\n"
                           f"us, % of the unique-bytes floor at {bw:.0f} GB/s copy bandwidth. "
                           f"plan_cascade 1024 x 2K blocks: {plan_line}\n\n{table}\n")
    elif a.out:
        C.write_json(a.out, BENCH, results)


if __name__ == "__main__":
    main()
