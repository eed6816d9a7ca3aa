"""The engine's paged KV cache: every layer's K and V pages in one allocation.

``kv [L, 2, NB, BS, Hkv, D]``; ``k[l]`` / ``v[l]`` are ``[NB, BS, Hkv, D]`` views, the layout
``pb.write_kv`` / ``pb.paged_decode`` take. The pool is ``torch.empty``: slots no request owns
hold garbage, which the ops never use (docs/kv_layout.md). An fp8 pool (half the bytes of bf16)
stores K and V with per-tensor scales of 1.0, as vLLM's ``kv_cache_dtype="fp8"`` does without
calibrated scales: values beyond the format's range (448 for e4m3) saturate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import paged_backend as pb


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache now: free GPU memory (after the weights), or on the CPU the
    host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def blocks_for(spec: KVCacheSpec, *, num_blocks: int | None, kv_memory_fraction: float | None,
               max_useful_blocks: int) -> int:
    """The pool size: ``num_blocks`` as given, else ``kv_memory_fraction`` of the memory available
    now (default 0.9 on a GPU, 0.25 on the CPU), never more than ``max_useful_blocks`` (what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens could hold)."""
    if num_blocks is not None and kv_memory_fraction is not None:
        raise ValueError("give num_blocks or kv_memory_fraction, not both")
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        return num_blocks
    if kv_memory_fraction is None:
        kv_memory_fraction = 0.9 if spec.device.type == "cuda" else 0.25
    if isinstance(kv_memory_fraction, bool) or not isinstance(kv_memory_fraction, (int, float)) \
            or not 0.0 < kv_memory_fraction <= 1.0:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction!r}")
    fit = int(available_memory(spec.device) * kv_memory_fraction) // spec.bytes_per_block
    if fit < 1:
        raise ValueError(f"kv_memory_fraction={kv_memory_fraction} of the free memory holds no KV block "
                         f"({spec.bytes_per_block} bytes each); free memory or pass num_blocks")
    return min(fit, max_useful_blocks)


class PagedKVCache:
    """Per-layer paged K/V of ``num_blocks`` blocks (``spec`` gives the rest)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int):
        self.spec = spec
        self.num_blocks = num_blocks
        self.kv = self.k = self.v = None
        self.allocate()
        # what write_kv and the attention ops take with this cache: an fp8 one's scales
        self.scales = dict(k_scale=1.0, v_scale=1.0) if spec.dtype.itemsize == 1 else {}

    def allocate(self) -> None:
        """The pool's memory, made at construction and again after :meth:`release` (its contents
        undefined: no block holds KV)."""
        if self.kv is not None:
            return
        spec, n = self.spec, self.num_blocks
        try:
            self.kv = torch.empty(spec.num_layers, 2, n, spec.block_size, spec.num_kv_heads, spec.head_dim,
                                  dtype=spec.dtype, device=spec.device)
        except torch.OutOfMemoryError as e:
            raise ValueError(f"a KV cache of {n} blocks ({n * spec.bytes_per_block / 2 ** 30:.2f} GiB)"
                             f" does not fit on {spec.device}; lower num_blocks or kv_memory_fraction") from e
        self.k = list(self.kv[:, 0].unbind(0))  # L x [NB, BS, Hkv, D]
        self.v = list(self.kv[:, 1].unbind(0))

    def release(self) -> None:
        """Drops the pool's memory (``LLM.sleep``); :meth:`allocate` makes it again."""
        self.kv = self.k = self.v = None

    @property
    def nbytes(self) -> int:
        """The pool's bytes (allocated or not)."""
        return self.num_blocks * self.spec.bytes_per_block

    def copy_blocks(self, block_copies) -> None:
        """Copy-on-write block copies ``[K, 2] (src, dst)`` in every layer (the scheduler's
        ``ScheduledBatch.block_copies``, a numpy array); run before the step's writes."""
        if len(block_copies):
            pb.copy_blocks(self.k, self.v, block_copies)
