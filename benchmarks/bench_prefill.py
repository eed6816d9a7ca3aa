"""Paged prefill: ours vs torch SDPA flash (dense, causal) vs FlashInfer paged prefill.

Cases (bf16, Hq 32, Hkv 8, D 128, page 16, pages shuffled):
  1x8K                 one prompt, q_len = seq_len = 8192
  4x4K                 four prompts of 4096
  2K chunk over 30K    q_len 2048 appended to 30720 cached tokens (seq_len 32768)

FLOPs (causal) = 4 * D * Hq * sum over queries of the keys each attends to; the same count is
used for every implementation, so TFLOP/s compare times. SDPA runs on dense contiguous K/V
gathered from the pages beforehand (the gather is not timed). For the chunk case SDPA's
``is_causal`` would be top-left aligned (wrong for q_len < k_len), so it gets
``torch.nn.attention.bias.causal_lower_right`` (bottom-right), which runs the flash kernel with its
native bottom-right causal mask; if that fails, it runs non-causal over all keys and its TFLOP/s
use its own (larger) FLOP count - the table says which. FlashInfer's paged prefill is
bottom-right aligned already. Outputs of every peer are compared with ours (rel. error) and ours
with an fp64 reference on a sample of rows.

    python3 benchmarks/bench_prefill.py             # GPU: table + benchmarks/results/<gpu>.json/.md
    python3 benchmarks/bench_prefill.py --kv-dtype fp8   # the caches in e4m3 (scales 1/16): its own section
    python3 benchmarks/bench_prefill.py --sweep     # also time other tile configs of our kernel
    TRITON_INTERPRET=1 python3 benchmarks/bench_prefill.py --quick   # CPU smoke run, tiny shapes
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (free_memory, gpu_name, gpu_slug, md_table, now, rel_err, short_error, time_us,  # noqa: E402
                    versions, write_json, write_md_section)

import paged_backend as pb  # noqa: E402
from paged_backend.kernels.prefill import prefill_config, prefill_triton  # noqa: E402
from paged_backend.prefill import prefill_kernel_name  # noqa: E402
from peers import fi_prefill_backend  # noqa: E402

LN2 = math.log(2.0)
CASES = [
    ("1x8K", [8192], [8192]),
    ("4x4K", [4096] * 4, [4096] * 4),
    ("2K chunk over 30K", [2048], [32768]),
]
QUICK_CASES = [
    ("1x64", [64], [64]),
    ("2x32", [32, 32], [32, 32]),
    ("16 chunk over 48", [16], [64]),
]
SWEEP = [  # (block_m, block_n, num_warps, num_stages)
    (256, 64, 16, 3), (256, 64, 16, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2),
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 4),
]


def causal_key_count(q_lens, seq_lens) -> int:
    """Sum over queries of the number of keys each attends to (bottom-right causal)."""
    return sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(q_lens, seq_lens))


FP8_SCALE = 1.0 / 16  # k_scale = v_scale of --kv-dtype fp8 (the values are N(0, 1): e4m3's range is +-448)


def make_inputs(q_lens, seq_lens, hq, hkv, d, bs, dtype, device, seed=0, fp8=False):
    """``fp8``: the caches quantized to e4m3 with scales ``FP8_SCALE`` (``inp["scales"]``), else ``None``."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    nb = sum(need) + 1
    perm = torch.randperm(nb, generator=gen).to(torch.int32)
    table = torch.full((len(need), max(need)), int(perm[-1]), dtype=torch.int32)
    at = 0
    for b, m in enumerate(need):
        table[b, :m] = perm[at:at + m]
        at += m
    torch.manual_seed(seed)
    k = torch.randn(nb, bs, hkv, d, device=device).to(dtype)
    v = torch.randn(nb, bs, hkv, d, device=device).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, device=device).to(dtype)
    scales = None
    if fp8:
        k, v = ((c.float() / FP8_SCALE).to(torch.float8_e4m3fn) for c in (k, v))
        scales = tuple(torch.tensor([FP8_SCALE], device=device) for _ in range(2))
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return dict(q=q, k=k, v=v, bt=table.to(device), sl=sl.to(device), qsl=qsl.to(device), qsl_cpu=qsl, sl_cpu=sl,
                q_lens=list(q_lens), seq_lens=list(seq_lens), scales=scales)


def dense_kv(inp, b):
    """Dense contiguous ``[n, Hkv, D]`` K and V of request ``b`` (gathered from the pages; an fp8 cache's
    dequantized into q's dtype)."""
    n, bs = inp["seq_lens"][b], inp["k"].shape[1]
    pos = torch.arange(n, device=inp["k"].device)
    pages = inp["bt"][b].long()[pos // bs]
    k, v = inp["k"][pages, pos % bs], inp["v"][pages, pos % bs]
    if inp["scales"] is not None:
        k, v = ((c.float() * FP8_SCALE).to(inp["q"].dtype) for c in (k, v))
    return k.contiguous(), v.contiguous()


def sample_reference(inp, rows: int = 48):
    """fp64 attention of the first and last ``rows`` queries of every request -> (idx, o, lse)."""
    q, d = inp["q"], inp["q"].shape[-1]
    hq, hkv = q.shape[1], inp["k"].shape[2]
    starts = inp["qsl_cpu"].tolist()
    idx, outs, lses = [], [], []
    for b, (ql, n) in enumerate(zip(inp["q_lens"], inp["seq_lens"])):
        k, v = dense_kv(inp, b)
        k = k.double().repeat_interleave(hq // hkv, 1)
        v = v.double().repeat_interleave(hq // hkv, 1)
        local = sorted(set(range(min(rows, ql))) | set(range(max(0, ql - rows), ql)))
        qi = torch.tensor(local, device=q.device)
        s = torch.einsum("qhd,khd->hqk", q[starts[b] + qi].double(), k) * d ** -0.5
        pos = n - ql + qi
        s = s.masked_fill(torch.arange(n, device=q.device)[None, None, :] > pos[None, :, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v))
        lses.append(lse.transpose(0, 1))
        idx.append(starts[b] + qi)
    return torch.cat(idx), torch.cat(outs), torch.cat(lses)


# ----------------------------------------------------------------------------- implementations
def ours_impl(inp, cfg=None):
    args = (inp["q"], inp["k"], inp["v"], inp["bt"], inp["sl"], inp["qsl"])
    scales = inp["scales"]
    if cfg is None:
        kw = dict(query_start_loc_cpu=inp["qsl_cpu"], seq_lens_cpu=inp["sl_cpu"])
        if scales is not None:
            kw.update(k_scale=scales[0], v_scale=scales[1])
        return lambda: pb.paged_prefill(*args, **kw)
    q = inp["q"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    bm, bn, nw, ns = cfg

    def fn():
        prefill_triton(*args, q.shape[-1] ** -0.5, True, out, lse, block_m=bm, block_n=bn, num_warps=nw,
                       num_stages=ns, scales=scales or (None, None))
        return out, lse
    return fn


def sdpa_impl(inp):
    """-> (fn, note, flops_override or None). Dense equal-length batches only."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    q_lens, seq_lens = inp["q_lens"], inp["seq_lens"]
    if len(set(q_lens)) != 1 or len(set(seq_lens)) != 1:
        raise RuntimeError("ragged batch: no dense SDPA equivalent")
    b, ql, n = len(q_lens), q_lens[0], seq_lens[0]
    q = inp["q"]
    hq, d = q.shape[1], q.shape[2]
    kv = [dense_kv(inp, i) for i in range(b)]
    kd = torch.stack([k for k, _ in kv]).transpose(1, 2)  # [B, Hkv, n, D] view of contiguous [B, n, Hkv, D]
    vd = torch.stack([v for _, v in kv]).transpose(1, 2)
    del kv
    q4 = q.view(b, ql, hq, d).transpose(1, 2)
    cuda = q.is_cuda
    backend = SDPBackend.FLASH_ATTENTION if cuda else SDPBackend.MATH

    def unpack(o):
        return o.transpose(1, 2).reshape(b * ql, hq, d)

    tries = []
    if ql == n:
        tries.append(("flash is_causal" if cuda else "math is_causal",
                      lambda: F.scaled_dot_product_attention(q4, kd, vd, is_causal=True, enable_gqa=True), None))
    else:
        mask = causal_lower_right(ql, n)
        tries.append(("flash causal_lower_right" if cuda else "math causal_lower_right",
                      lambda: F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, enable_gqa=True), None))
        tries.append(("flash NON-causal over all keys (own FLOPs)",
                      lambda: F.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True), 4 * d * hq * b * ql * n))
    errors = []
    for note, call, flops in tries:
        def fn(call=call):
            with sdpa_kernel(backend):
                return unpack(call()), None
        try:
            fn()
            return fn, note, flops
        except Exception as e:  # noqa: BLE001 - record and try the next variant
            errors.append(f"{note}: {short_error(e, 160)}")
    raise RuntimeError("; ".join(errors))


def flashinfer_impl(inp, backend: str):
    if not inp["q"].is_cuda:
        raise RuntimeError("needs CUDA")
    import flashinfer
    q, k, v = inp["q"], inp["k"], inp["v"]
    bs, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    seq_lens = inp["seq_lens"]
    need = torch.tensor([-(-n // bs) for n in seq_lens], dtype=torch.int32)
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(need, 0)
    live = torch.arange(inp["bt"].shape[1])[None, :] < need[:, None]
    indices = inp["bt"].cpu()[live].to(torch.int32)
    last = torch.tensor([(n - 1) % bs + 1 for n in seq_lens], dtype=torch.int32)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    backend = fi_prefill_backend(backend, q.dtype, k.dtype)
    try:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    except TypeError:  # releases without the backend argument
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    dev = q.device
    w.plan(inp["qsl"], kv_indptr.to(dev), indices.to(dev), last.to(dev), q.shape[1], hkv, d, bs,
           causal=True, q_data_type=q.dtype, kv_data_type=k.dtype)

    scale = {} if inp["scales"] is None else dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)

    def fn():
        o, lse2 = w.run(q, (k, v), return_lse=True, **scale)
        return o, lse2 * LN2  # FlashInfer's LSE is base 2
    return fn, f"backend={backend}"


# ----------------------------------------------------------------------------- driver
def run_case(name, q_lens, seq_lens, args, dtype, device):
    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.page
    inp = make_inputs(q_lens, seq_lens, hq, hkv, d, bs, dtype, device, fp8=args.kv_dtype == "fp8")
    flops = 4 * d * hq * causal_key_count(q_lens, seq_lens)
    row = dict(case=name, q_lens=q_lens, seq_lens=seq_lens, flops=flops, impls={})
    print(f"\n== {name}: T={sum(q_lens)} keys={sum(seq_lens)} GFLOP={flops / 1e9:.1f}", flush=True)

    def record(label, fn, note="", own_flops=None, ref_out=None):
        try:
            out = fn()
            us = time_us(fn, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
            f = own_flops or flops
            ent = dict(us=us, tflops=f / (us * 1e-6) / 1e12, note=note)
            if own_flops:
                ent["flops"] = own_flops
            if ref_out is not None:
                ent["rel_err_vs_ours"] = rel_err(out[0].float(), ref_out.float())
            row["impls"][label] = ent
            print(f"  {label:<28} {us:10.1f} us  {ent['tflops']:7.3g} TFLOP/s  {note}"
                  + (f"  err vs ours {ent['rel_err_vs_ours']:.1e}" if "rel_err_vs_ours" in ent else ""),
                  flush=True)
            return out
        except Exception as e:  # noqa: BLE001 - a failing peer is recorded, never fatal
            row["impls"][label] = dict(error=short_error(e))
            print(f"  {label:<28} ERROR {short_error(e)}", flush=True)
            return None

    cfg = prefill_config(dtype, d, hq // hkv, torch.device(device))
    portable = "bm{block_m} bn{block_n} w{num_warps} s{num_stages}".format(**cfg)
    path = prefill_kernel_name(inp["q"], inp["k"], inp["v"], scales=inp["scales"] or (None, None))
    row["path"] = path
    res = record("ours", ours_impl(inp), note=f"{path} kernel" + ("" if path == "sm90" else f", {portable}"))
    ours_out = None
    if res is not None:
        ours_out, ours_lse = res
        idx, ro, rl = sample_reference(inp)
        row["impls"]["ours"]["rel_err_vs_fp64_sample"] = rel_err(ours_out[idx].float(), ro)
        row["impls"]["ours"]["lse_err_vs_fp64_sample"] = (ours_lse[idx].double() - rl).abs().max().item()
        print(f"  {'':<28} fp64 sample: rel err {row['impls']['ours']['rel_err_vs_fp64_sample']:.1e}, "
              f"lse err {row['impls']['ours']['lse_err_vs_fp64_sample']:.1e}")
    if path == "sm90":  # the portable kernel on the same inputs, for the dispatch's gain
        tiles = tuple(cfg[k] for k in ("block_m", "block_n", "num_warps", "num_stages"))
        record("ours portable", ours_impl(inp, tiles), note=portable, ref_out=ours_out)
    if args.sweep and device != "cpu":
        for c in SWEEP:
            record("ours bm%d bn%d w%d s%d" % c, ours_impl(inp, c), ref_out=ours_out)
    try:
        fn, note, own = sdpa_impl(inp)
        record("sdpa", fn, note=note, own_flops=own, ref_out=ours_out)
    except Exception as e:  # noqa: BLE001
        row["impls"]["sdpa"] = dict(error=short_error(e))
        print(f"  {'sdpa':<28} ERROR {short_error(e)}")
    free_memory()
    if not args.no_flashinfer:
        try:
            fn, note = flashinfer_impl(inp, args.fi_backend)
            record("flashinfer", fn, note=note, ref_out=ours_out)
        except Exception as e:  # noqa: BLE001
            row["impls"]["flashinfer"] = dict(error=short_error(e))
            print(f"  {'flashinfer':<28} ERROR {short_error(e)}")
    sd = row["impls"].get("sdpa", {}).get("tflops")
    for ent in row["impls"].values():
        if sd and "tflops" in ent:
            ent["pct_of_sdpa"] = 100.0 * ent["tflops"] / sd
    del inp
    free_memory()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run; fp32 on CPU)")
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs of our kernel (GPU)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fi-backend", default="auto", help="FlashInfer prefill backend: auto, fa2, fa3")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--warmup-ms", type=int, default=100)
    ap.add_argument("--rep-ms", type=int, default=500)
    ap.add_argument("--save", action="store_true", help="write results files even with --quick")
    ap.add_argument("--kv-dtype", choices=["fp8"], help="e4m3 caches (scales 1/16): SDPA on them dequantized, "
                    "results in a section of their own")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The interpreter cannot do bf16 arithmetic, and the CPU torch path is slow in bf16: fp32 on CPU.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cases = QUICK_CASES if args.quick else CASES
    if args.quick:
        args.heads, args.kv_heads, args.head_dim, args.page = 8, 2, 64, 16
        args.warmup_ms, args.rep_ms = 10, 50
    print(f"bench_prefill on {gpu_name(device)}, {str(dtype).replace('torch.', '')}, Hq {args.heads}, "
          f"Hkv {args.kv_heads}, D {args.head_dim}, page {args.page} shuffled; {versions()}")
    rows = [run_case(name, ql, sl, args, dtype, device) for name, ql, sl in cases]

    labels = ["ours", "ours portable", "sdpa", "flashinfer"]
    table = []
    for r in rows:
        cells = [r["case"], r.get("path", "-"), f"{r['flops'] / 1e12:.2f}"]
        for lab in labels:
            e = r["impls"].get(lab, {})
            cells.append(f"{e['us']:.0f} us, {e['tflops']:.3g}" if "tflops" in e else ("-" if not e else "error"))
        o, s, fi = r["impls"].get("ours", {}), r["impls"].get("sdpa", {}), r["impls"].get("flashinfer", {})
        cells.append(f"{o['pct_of_sdpa']:.0f}%" if "pct_of_sdpa" in o else "-")
        cells.append(f"{fi['us'] / o['us']:.2f}x" if "us" in o and "us" in fi else "-")
        cells.append(s.get("note", "-"))
        table.append(cells)
    header = ["case", "our kernel", "TFLOP", "ours (TFLOP/s)", "ours portable (TFLOP/s)", "SDPA flash (TFLOP/s)",
              "FlashInfer paged (TFLOP/s)", "ours % of SDPA", "ours vs FlashInfer", "SDPA variant"]
    md = md_table(header, table)
    print("\n" + md)
    if args.quick and not args.save:
        return
    slug = gpu_slug(device)
    res_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    payload = dict(when=now(), gpu=gpu_name(device), versions=versions(), dtype=str(dtype),
                   heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, page=args.page,
                   flops_rule="4*D*Hq*sum_q keys attended (bottom-right causal)", cases=rows)
    key, title, cache = "prefill", "Paged prefill", ""
    if args.kv_dtype:  # (SDPA runs on the cache dequantized beforehand, untimed)
        key, title = "prefill:fp8", "Paged prefill over an fp8 (e4m3) cache"
        cache = f" queries over an e4m3 cache (scales {FP8_SCALE}; SDPA on it dequantized beforehand)"
        payload.update(kv_dtype="float8_e4m3fn", kv_scale=FP8_SCALE)
    write_json(os.path.join(res_dir, f"{slug}.json"), key, payload)
    text = (f"## {title} ({gpu_name(device)}, {now()})\n\n{str(dtype).replace('torch.', '')}{cache}, Hq "
            f"{args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, page {args.page} shuffled. TFLOP/s on "
            f"4*D*Hq*sum(keys attended).\n\n{md}\n")
    write_md_section(os.path.join(res_dir, f"{slug}.md"), key, text)
    print(f"\nwrote {res_dir}/{slug}.json and {slug}.md")


if __name__ == "__main__":
    main()
