"""The vLLM plug-in's per-step costs, through vLLM 0.33's own classes on the GPU: the builder's host
time (``build``: split, plan; a cascade plan adds the block table's device-to-host copy) and one
layer's attention (``impl.forward``), cascade against flat decode on the same step.

    python3 benchmarks/bench_vllm.py [--out R.json] [--md R.md]

vLLM must import (on the lent GPU: its Python files and light requirements carried, docs/vllm.md;
``VLLM_TARGET_DEVICE=cpu`` because its CUDA platform needs its compiled ops, which the tensors here
never touch). Cases: ``ragged`` (64 requests of 1K-8K tokens, nothing shared), ``ragged-short`` (256 of
128-1K tokens: the tails-only plans of full graphs against flat decode where a flat plan need not
split) and the prefix/n/suffix shapes of bench_cascade. bf16, Hq 32, Hkv 8, D 128, page 16. ``build`` is timed
with the GPU idle, and the cascade build again with ~1 ms of work queued (``build_busy``): by the
first-column path it waits for that work (its copy syncs), which a flat build never does; with the
rows' request slots (Model Runner V2) it copies nothing back. Builds repeat the same step, so a
cascade build carries the last one's forest, as a decode step after the first does
(``build_cascade_new_us``: the forest found anew each time, as the first step of a batch).
``break-even`` = layers after which cascade's saving per layer pays its extra (carried) build time.
``full_graph``: the builder as vLLM makes it with full decode graphs under Model Runner V2 (the rows'
request slots): the batch's plan in the fixed arena every captured size shares, which one graph per
batch size replays whatever the forest - a cascade where rows share blocks, tails only where none do
(``ragged``) - against the flat plan in a graph (``attn_flat_graph_us``), the one such steps took before.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from bench_cascade import BS, CASES, D, HKV, HQ, build  # noqa: E402

BENCH = "vllm"
SHAPES = ["ragged", "ragged-short", "8192/64/256", "4096/256/128", "32768/16/512"]
# nothing shared: (requests, shortest, longest context)
RAGGED = {"ragged": (64, 1024, 8192), "ragged-short": (256, 128, 1024)}


def vllm_step(table: np.ndarray, lens: np.ndarray, device, slots: bool = False):
    """A decode step's metadata as vLLM's runner builds it; ``slots``: with the rows' request slots and
    their prefilling flags on the host, as Model Runner V2 gives them (the builder's no-sync path)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    b = len(lens)
    extra = dict(req_idx=np.arange(b, dtype=np.int32), is_prefilling=torch.zeros(b, dtype=torch.bool)) if slots else {}
    seq = torch.from_numpy(lens.astype(np.int32))
    qsl = torch.arange(b + 1, dtype=torch.int32)
    mapping = torch.from_numpy((table[np.arange(b), (lens - 1) // BS] * BS + (lens - 1) % BS).astype(np.int64))
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device), num_reqs=b,
        num_actual_tokens=b, max_query_len=1, max_seq_len=int(lens.max()),
        block_table_tensor=torch.from_numpy(table.astype(np.int32)).to(device), slot_mapping=mapping.to(device),
        seq_lens_cpu_upper_bound=seq, **extra)


def case_inputs(name: str, device):
    if name in RAGGED:
        rows, lo, hi = RAGGED[name]
        gen = np.random.default_rng(0)
        lens = gen.integers(lo, hi + 1, rows)
        need = -(-lens // BS)
        perm = gen.permutation(int(need.sum())).astype(np.int32)
        table = np.zeros((rows, int(need.max())), np.int32)
        at = 0
        for i, n in enumerate(need):
            table[i, :n] = perm[at:at + n]
            at += n
        nb = int(need.sum())
    else:
        case = build(CASES[name], torch.bfloat16, "cpu")
        table, lens = case["table"], case["lens"]
        nb = int(table.max()) + 1
    torch.manual_seed(0)
    kv = torch.randn(nb, BS, HKV, 2 * D, device=device, dtype=torch.bfloat16).transpose(1, 2)  # vLLM's LBNHC
    q = torch.randn(len(lens), HQ, D, device=device, dtype=torch.bfloat16)
    return table, lens, kv, q


def run_case(name: str, device) -> dict:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import paged_backend as pb
    from paged_backend.integration.vllm.backend import PagedAttentionBackend
    table, lens, kv, q = case_inputs(name, device)
    cfg = VllmConfig()
    row = {"case": name, "batch": len(lens), "tokens": int(lens.sum())}
    with set_current_vllm_config(cfg):
        layer = Attention(HQ, D, D ** -0.5, num_kv_heads=HKV, prefix="l0", attn_backend=PagedAttentionBackend)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)
        cm = vllm_step(table, lens, device)
        out = torch.empty_like(q)
        results = {}
        for mode in ("flat", "cascade"):
            os.environ["PAGED_BACKEND_CASCADE"] = "1" if mode == "cascade" else "0"
            builder = PagedAttentionBackend.get_builder_cls()(spec, ["l0"], cfg, torch.device(device))
            torch.cuda.synchronize()
            build_us = C.host_time_us(lambda: builder.build(0, cm), calls=50)
            new_us = C.host_time_us(lambda: (builder.planner.reset(), builder.build(0, cm)), calls=20)
            md = builder.build(0, cm)
            fwd = lambda md=md: layer.impl.forward(layer, q, None, None, kv, md, out)  # noqa: E731
            fwd()
            results[mode] = dict(build_us=build_us, new_us=new_us, attn_us=C.time_us(fwd, device), out=out.clone(),
                                 cascade=isinstance(md.plans[None], pb.CascadePlan))
            # in a CUDA graph: the GPU's time without the eager launches (a full decode graph
            # replays flat plans; a cascade plan replays too while the step's forest is unchanged)
            results[mode]["graph_us"] = C.graph_time_us([fwd])
        results["full_graph"] = full_graph_case(cfg, spec, layer, q, kv, table, lens, device)
        # behind a busy GPU (~1 ms of queued work, as vLLM's async scheduling builds step N + 1 while step
        # N runs): the first-column path waits for it (its copy syncs), the request-slot path does not
        slot_step = vllm_step(table, lens, device, slots=True)
        busy = {"sync": busy_build_us(builder, cm), "slots": busy_build_us(builder, slot_step)}
    f, c, g = results["flat"], results["cascade"], results["full_graph"]
    err = C.rel_err(c["out"], f["out"])
    saved = f["attn_us"] - c["attn_us"]
    row.update(build_flat_us=f["build_us"], build_cascade_us=c["build_us"], build_cascade_new_us=c["new_us"],
               build_busy_sync_us=busy["sync"], build_busy_slots_us=busy["slots"],
               attn_flat_us=f["attn_us"],
               attn_flat_graph_us=f["graph_us"], attn_cascade_us=c["attn_us"], attn_cascade_graph_us=c["graph_us"],
               cascade_chosen=c["cascade"], build_full_graph_us=g["build_us"], attn_full_graph_us=g["graph_us"],
               full_graph_nodes=g["nodes"], full_graph_vs_flat_rel_err=C.rel_err(g["out"], f["out"]),
               cascade_vs_flat_rel_err=err,
               break_even_layers=(c["build_us"] - f["build_us"]) / saved if c["cascade"] and saved > 0 else None)
    return row


def full_graph_case(cfg, spec, layer, q, kv, table, lens, device) -> dict:
    """The step as a full decode graph of its batch size runs it under Model Runner V2 (the module doc):
    a graph captured with the size's first plan (its host tables empty yet: tails only) replays the
    step's later plans (the forest found from the tables the first build sent, then carried) ->
    {build_us (carried), graph_us, nodes, out}."""
    from vllm.config.compilation import CUDAGraphMode

    from paged_backend.integration.vllm.backend import PagedAttentionBackend
    os.environ["PAGED_BACKEND_CASCADE"], os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1", "1"
    comp = cfg.compilation_config
    comp.cudagraph_mode, comp.max_cudagraph_capture_size = CUDAGraphMode.FULL_DECODE_ONLY, max(512, len(lens))
    builder = PagedAttentionBackend.get_builder_cls()(spec, ["l0"], cfg, torch.device(device))
    cm = vllm_step(table, lens, device, slots=True)
    out = torch.empty_like(q)
    md = builder.build(0, cm)  # (the first: tails only)
    fwd = lambda: layer.impl.forward(layer, q, None, None, kv, md, out)  # noqa: E731
    fwd()
    graph, calls = torch.cuda.CUDAGraph(), 10  # (calls a replay: as C.graph_time_us times the other modes)
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fwd()
    build_us = C.host_time_us(lambda: builder.build(0, cm), calls=50)  # (the plans after: in the same arena)
    plan = builder.build(0, cm).plans[None]
    graph.replay()
    return dict(build_us=build_us, graph_us=C.time_us(graph.replay, device) / calls, nodes=plan.num_nodes,
                out=out.clone())


def busy_build_us(builder, cm, calls: int = 20, busy_ms: float = 1.0) -> float:
    """Median host time of ``builder.build`` called with ~``busy_ms`` of work queued on the GPU (the
    forest carried and, with request slots, the rows sent by a build before)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 20)
    end.record()
    end.synchronize()
    cycles = int((1 << 20) * busy_ms / start.elapsed_time(end))
    builder.build(0, cm)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        builder.build(0, cm)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return float(np.median(times) * 1e6)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    slug = C.gpu_slug() if torch.cuda.is_available() else "cpu"
    ap.add_argument("--out", default=os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.json"))
    ap.add_argument("--md", default=os.path.join(C.ROOT, "benchmarks", "results", f"{slug}.md"))
    args = ap.parse_args()
    try:
        import vllm
    except ImportError as e:
        print(f"bench_vllm skipped: vLLM does not import ({C.short_error(e)}); see docs/vllm.md")
        return
    rows = []
    for name in SHAPES:
        try:
            rows.append(run_case(name, "cuda"))
        except Exception as e:  # recorded, never fatal
            rows.append({"case": name, "error": C.short_error(e)})
        print(rows[-1], flush=True)
    C.write_json(args.out, BENCH, {"when": C.now(), "gpu": C.gpu_name(), "versions": {**C.versions(),
                 "vllm": vllm.__version__}, "rows": rows})
    fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
    keys = ["case", "batch", "build_flat_us", "build_cascade_us", "build_cascade_new_us", "build_busy_sync_us",
            "build_busy_slots_us", "attn_flat_us",
            "attn_flat_graph_us", "attn_cascade_us", "attn_cascade_graph_us", "cascade_chosen", "break_even_layers",
            "cascade_vs_flat_rel_err", "build_full_graph_us", "attn_full_graph_us", "full_graph_nodes",
            "full_graph_vs_flat_rel_err"]
    table = C.md_table(keys, [[fmt(r.get(k)) if not k.endswith("rel_err") or "error" in r
                               else f"{r[k]:.1e}" for k in keys] for r in rows])
    text = (f"## vLLM plug-in: per-step build and attention ({C.gpu_name()}, {C.now()}, vLLM {vllm.__version__})\n\n"
            f"bf16, Hq {HQ}, Hkv {HKV}, D {D}, page {BS}; times in us; build = host time with the GPU idle; "
            "build_busy = a cascade build with ~1 ms of work queued on the GPU, by the first-column path (its "
            "copy syncs) and by the rows' request slots (Model Runner V2's metadata: no sync); full_graph = the "
            "step in a full decode graph under Model Runner V2 (fixed arena: cascade or tails only, "
            "full_graph_nodes nodes).\n\n"
            + table + "\n")
    C.write_md_section(args.md, BENCH, text)
    print(text)


if __name__ == "__main__":
    main()
