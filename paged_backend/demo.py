"""Decode demo: write a ragged batch into a shuffled paged cache, decode it, check it, time it.

    python -m paged_backend.demo [--batch 8] [--max-len 4096] [--device cuda]

Runs the Triton kernels on a GPU, the vectorised torch path on a CPU (or the Triton kernels on
the CPU under TRITON_INTERPRET=1, slowly: pass a small --max-len).
"""
from __future__ import annotations

import argparse
import time

import torch

import paged_backend as pb


def dense_attention(q, key, value, lens, scale):
    """Per request, plain fp64 softmax attention over its tokens (independent of the kernels)."""
    outs = []
    group = q.shape[1] // key.shape[1]
    at = 0
    for b, n in enumerate(lens):
        k = key[at:at + n].double().repeat_interleave(group, 1)
        v = value[at:at + n].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v))
        at += n
    return torch.stack(outs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, args.max_len + 1, (args.batch,), generator=g).tolist()
    lens[0] = args.max_len
    bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
    blocks = [-(-n // bs) for n in lens]
    nb = sum(blocks)
    k_cache = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    # Shuffled pages, as a real cache looks after many allocations and frees.
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(args.batch, max(blocks), dtype=torch.int32)
    slots, at = [], 0
    for b, n in enumerate(lens):
        table[b, :blocks[b]] = perm[at:at + blocks[b]].to(torch.int32)
        at += blocks[b]
        pos = torch.arange(n)
        slots.append(table[b, pos // bs].long() * bs + pos % bs)
    total = sum(lens)
    key = torch.randn(total, hkv, d, generator=g).to(dtype)
    value = torch.randn(total, hkv, d, generator=g).to(dtype)
    pb.write_kv(key.to(dev), value.to(dev), k_cache, v_cache, torch.cat(slots).to(dev))
    q = torch.randn(args.batch, args.q_heads, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = pb.plan_decode(seq_lens, num_q_heads=args.q_heads, num_kv_heads=hkv, head_dim=d, block_size=bs,
                          device=dev)
    inputs = (q.to(dev), k_cache, v_cache, table.to(dev), seq_lens.to(dev))
    out, lse = pb.paged_decode(*inputs, plan=plan)
    ref = dense_attention(q, key, value, lens, d ** -0.5)
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    reps = 20
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        pb.paged_decode(*inputs, plan=plan)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / reps
    kv_bytes = total * hkv * d * 2 * k_cache.element_size()
    print(f"paged decode: batch {args.batch}, lengths {min(lens)}..{max(lens)} ({total} tokens), "
          f"Hq {args.q_heads}, Hkv {hkv}, D {d}, page {bs}, {str(dtype).replace('torch.', '')} on {dev}")
    print(f"check vs dense fp64 reference: rel err {err:.2e} (tolerance {tol:.0e}) -> {'OK' if err <= tol else 'FAIL'}")
    print(f"speed: {dt * 1e6:.1f} us per decode step, {kv_bytes / dt / 1e9:.2f} GB/s of KV read")
    if err > tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
