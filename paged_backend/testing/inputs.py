"""Random paged-cache inputs: shuffled pages, ragged and empty rows, both KV layouts (ours and
vLLM's), padding table entries and padding requests, values poisoned outside every row, strided
metadata views, fp8 caches. Shapes: ``B`` requests, ``Hq``/``Hkv`` query/KV heads, ``D`` head
dim, ``NB`` blocks, ``BS`` block size. Random values come from torch's global generator (seed it,
or build inside ``torch.random.fork_rng``)."""
from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype,
               device="cpu", layout: str = "nhd", scale: float = 1.0):
    """-> (k_cache, v_cache) ``[NB, BS, Hkv, D]``, values ~N(0, 1) (K times ``scale``) rounded to ``dtype``.

    ``layout="vllm"`` returns K and V as non-contiguous views of one ``[NB, Hkv, BS, 2D]`` buffer
    (no copy), as vLLM's cache looks; ``"nhd"`` returns two contiguous tensors.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "nhd":
        k = torch.randn(shape, dtype=torch.float32, device=device) * scale
        v = torch.randn(shape, dtype=torch.float32, device=device)
        return k.to(dtype), v.to(dtype)
    if layout == "vllm":
        buf = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_dim, device=device).to(dtype)
        buf[..., :head_dim] *= scale
        k = buf[..., :head_dim].permute(0, 2, 1, 3)
        v = buf[..., head_dim:].permute(0, 2, 1, 3)
        return k, v
    raise ValueError(layout)


def make_fp8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype,
                   k_scale: float, v_scale: float, device="cpu", layout: str = "nhd"):
    """An fp8 cache holding real values ~N(0, 1) stored as ``x / scale`` (saturated to the
    format's range, as ``write_kv`` stores them) -> (k_cache, v_cache) ``[NB, BS, Hkv, D]``."""
    k, v = make_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, device, layout)
    top = torch.finfo(kv_dtype).max
    k.copy_((k / k_scale).clamp(-top, top))
    v.copy_((v / v_scale).clamp(-top, top))
    if layout == "nhd":
        return k.to(kv_dtype), v.to(kv_dtype)
    buf = torch.cat([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)], dim=-1).to(kv_dtype)  # [NB, Hkv, BS, 2D]
    return buf[..., :head_dim].permute(0, 2, 1, 3), buf[..., head_dim:].permute(0, 2, 1, 3)


def make_block_table(seq_lens, block_size: int, num_blocks: int, extra_cols: int = 0, device="cpu",
                     generator=None):
    """Shuffled, disjoint pages per request; unused entries hold garbage ids (they must never be read).

    -> block_table [B, max_blocks] int32 with max_blocks >= the longest request's blocks.
    """
    need = [-(-int(n) // block_size) for n in seq_lens]
    cols = max(need + [1]) + extra_cols
    if sum(need) > num_blocks:
        raise ValueError("not enough blocks")
    perm = torch.randperm(num_blocks, generator=generator)
    table = torch.randint(-5, 10 ** 6, (len(need), cols), generator=generator, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return table.to(device)


def make_decode_inputs(seq_lens, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                       device="cpu", layout: str = "nhd", spare_blocks: int = 3, q_scale: float = 1.0):
    """-> (q [B, Hq, D], k_cache, v_cache, block_table, seq_lens int32)."""
    need = sum(-(-int(n) // block_size) for n in seq_lens)
    nb = need + spare_blocks
    k, v = make_cache(nb, block_size, num_kv_heads, head_dim, dtype, device, layout)
    bt = make_block_table(seq_lens, block_size, nb, device=device)
    q = (torch.randn(len(seq_lens), num_q_heads, head_dim, device=device) * q_scale).to(dtype)
    return q, k, v, bt, torch.tensor(list(seq_lens), dtype=torch.int32, device=device)


def make_prefill_inputs(seq_lens, q_lens, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype, device="cpu", layout: str = "nhd", spare_blocks: int = 3, q_scale: float = 1.0):
    """Request ``b`` has ``seq_lens[b]`` keys, its last ``q_lens[b]`` tokens the queries (``q_len ==
    seq_len``: a whole prompt; shorter: a chunk over a cached prefix; 0: no queries) -> (q [T, Hq, D],
    k_cache, v_cache, block_table, seq_lens int32, query_start_loc [B+1] int32)."""
    if any(ql > n for ql, n in zip(q_lens, seq_lens)):
        raise ValueError("q_len > seq_len")
    _, k, v, bt, sl = make_decode_inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                         device, layout, spare_blocks)
    qsl = torch.tensor([0] + torch.tensor(list(q_lens)).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = (torch.randn(int(qsl[-1]), num_q_heads, head_dim, device=device) * q_scale).to(dtype)
    return q, k, v, bt, sl, qsl


def make_shared_prefix_table(groups, block_size: int, spare_blocks: int = 2, generator=None):
    """Cascade batches. ``groups``: ``[(prefix_blocks, [tail_len, ...]), ...]``: each member of a
    group starts with the group's ``prefix_blocks`` full blocks (the same block ids) and goes on
    with ``tail_len`` tokens of its own (ending mid-block unless a multiple of ``BS``). Block ids
    are shuffled; entries past a row's blocks hold the id of a spare block (padding, never read).
    -> (block_table [B, max_blocks] int32, seq_lens [B] int32, num_blocks)."""
    rows, lens = [], []
    next_id = 0
    for prefix, tails in groups:
        shared = list(range(next_id, next_id + prefix))
        next_id += prefix
        for t in tails:
            own = -(-int(t) // block_size)
            rows.append(shared + list(range(next_id, next_id + own)))
            next_id += own
            lens.append(prefix * block_size + int(t))
    nb = next_id + spare_blocks
    perm = torch.randperm(nb, generator=generator).to(torch.int32)
    cols = max(len(r) for r in rows) + 1
    table = torch.full((len(rows), cols), int(perm[-1]), dtype=torch.int32)
    for b, r in enumerate(rows):
        if r:
            table[b, :len(r)] = perm[torch.tensor(r, dtype=torch.long)]
    return table, torch.tensor(lens, dtype=torch.int32), nb


def pad_table(block_table, seq_lens, block_size: int, pad_block: int):
    """A copy of ``block_table`` whose entries past each row's last used block are ``pad_block``
    (a real block id, as engines pad tables; what it holds must never be read)."""
    bt = block_table.clone()
    used = (seq_lens.long().cpu() + block_size - 1) // block_size
    cols = torch.arange(bt.shape[1])
    bt[cols[None, :] >= used[:, None]] = pad_block
    return bt


def poison_outside(k_cache, v_cache, block_table, seq_lens, value: float, which: str = "kv"):
    """Writes ``value`` (NaN, +-inf) into every cache slot that no request's tokens ``[0, seq_len)``
    occupy: unused rows of last blocks, blocks only padding entries point to, unused blocks.
    ``which``: "k", "v" or "kv". In place; returns the caches. An fp8 cache gets ``value`` in its
    format (float8_e4m3fn has no infinities: they become NaN), written through its bytes (torch
    fills no fp8 tensor)."""
    nb, bs = k_cache.shape[:2]
    live = torch.zeros(nb * bs, dtype=torch.bool)
    bt = block_table.long().cpu()
    for b, n in enumerate(seq_lens.long().cpu().tolist()):
        pos = torch.arange(n)
        live[bt[b, pos // bs] * bs + pos % bs] = True
    dead = (~live).view(nb, bs).to(k_cache.device)
    for name, cache in (("k", k_cache), ("v", v_cache)):
        if name in which:
            if cache.element_size() == 1:
                cache.view(torch.uint8)[dead] = torch.tensor(value).to(cache.dtype).view(torch.uint8).item()
            else:
                cache[dead] = value
    return k_cache, v_cache


def strided(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the same values and a stride of 2 elements along its last dim (and
    rows further apart): how metadata arrives as a column of a wider host or device buffer."""
    junk = torch.full_like(t, -7)
    return torch.stack([t, junk], dim=-1)[..., 0]


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data starts 1 element past a 16-byte boundary (what TMA cannot read)."""
    view = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def of_fused_rows(q: torch.Tensor, extra_heads: int) -> torch.Tensor:
    """A copy of queries ``[T, Hq, D]`` as the first ``Hq`` heads of wider rows (a fused QKV projection's
    output: ``extra_heads`` more heads a row)."""
    t, hq, d = q.shape
    view = torch.zeros(t, hq + extra_heads, d, dtype=q.dtype, device=q.device)[:, :hq]
    view.copy_(q)
    return view
