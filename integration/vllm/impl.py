"""The per-layer attention of the vLLM backend: the KV write (``do_kv_cache_update``, before
``forward``) and the attention of the step's decode and prefill rows into vLLM's output buffer."""
from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

import paged_backend as pb

from .builder import PagedAttentionMetadata

# vLLM's fp8 cache dtypes (allocated as uint8) -> what the kernels read (e4m3fn: NVIDIA's fp8)
FP8_VIEWS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class PagedAttentionImpl(AttentionImpl[PagedAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        refused = {"ALiBi": alibi_slopes is not None,
                   f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "float16", "bfloat16", *FP8_VIEWS),
                   f"attention type {attn_type}": attn_type != AttentionType.DECODER}
        missing = [name for name, asked in refused.items() if asked]
        if missing:  # vLLM's supports_* checks refuse these first; this guards direct use
            raise NotImplementedError(f"paged-backend does not support {', '.join(missing)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.softcap = logits_soft_cap or None  # (vLLM passes 0 or None for none)
        # vLLM's sliding_window counts the query's own key, as ours does (its FlashAttention gets
        # window_size (sliding_window - 1, 0)); the builder plans per window of its layers
        self.window = sliding_window
        self.fp8 = FP8_VIEWS.get(kv_cache_dtype)  # None: the cache holds the model's dtype
        sinks = kwargs.get("sinks")  # [Hq] of this rank: a parameter loaded later, so read per call
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape [{num_heads}] (one per query head), got {list(sinks.shape)}")
        self.sinks = sinks

    def _caches(self, kv_cache: torch.Tensor):
        # vLLM's per-layer cache is [NB, Hkv, BS, 2D] (K and V side by side in the last dim):
        # [NB, BS, Hkv, D] views of it, no copy (any strides are accepted); fp8 ones come as uint8
        if self.fp8 is not None:
            kv_cache = kv_cache.view(self.fp8)
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def _scales(self, layer) -> dict:
        """An fp8 cache's per-tensor scales: the layer's ``_k_scale``/``_v_scale`` (0-d fp32 tensors
        that checkpoints or calibration fill; 1.0 by default), read by the kernels on the device."""
        return {} if self.fp8 is None else dict(k_scale=layer._k_scale, v_scale=layer._v_scale)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value [T, Hkv, D] (may be padded past slot_mapping's length; -1 slots are skipped)."""
        k_cache, v_cache = self._caches(kv_cache)
        n = slot_mapping.shape[0]
        pb.write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping, **self._scales(layer))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: PagedAttentionMetadata, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """query [T, Hq, D] (T may be padded) -> output [T, Hq, D], written in place."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("paged-backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        md = attn_metadata
        k_cache, v_cache = self._caches(kv_cache)
        sinks = None if self.sinks is None else self.sinks.float()  # (gpt-oss keeps them in bf16)
        scales = self._scales(layer)
        nd, ndt, t = md.num_decodes, md.num_decode_tokens, md.num_actual_tokens
        if nd:
            # decode row i is token i (a full graph's padding requests have no token and length 0:
            # their rows, padding tokens, get zeros; padding tokens past nd are left alone)
            q, plan = query[:nd], md.plans[self.window]
            if isinstance(plan, pb.CascadePlan):
                output[:nd] = pb.cascade_decode(q, k_cache, v_cache, plan, return_lse=False, scale=self.scale,
                                                softcap=self.softcap, sinks=sinks, window=self.window, **scales)
            else:
                pb.paged_decode(q, k_cache, v_cache, md.block_table[:nd], md.seq_lens[:nd], scale=self.scale,
                                plan=plan, return_lse=False, out=output[:nd], softcap=self.softcap, sinks=sinks,
                                window=self.window, **scales)
        if md.num_prefills:
            output[ndt:t] = pb.paged_prefill(
                query[ndt:t], k_cache, v_cache, md.block_table[nd:], md.seq_lens[nd:], md.prefill_query_start_loc,
                causal=True, return_lse=False, scale=self.scale, query_start_loc_cpu=md.prefill_query_start_loc_host,
                softcap=self.softcap, sinks=sinks, window=self.window, **scales)
        return output
