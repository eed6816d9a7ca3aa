"""The per-layer attention of the vLLM backend: the KV write (``do_kv_cache_update``, before
``forward``) and the attention of the step's decode and prefill rows into vLLM's output buffer."""
from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

import paged_backend as pb

from .builder import PagedAttentionMetadata


class PagedAttentionImpl(AttentionImpl[PagedAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        refused = {"ALiBi": alibi_slopes is not None, f"sliding window {sliding_window}": sliding_window is not None,
                   f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "float16", "bfloat16"),
                   f"attention type {attn_type}": attn_type != AttentionType.DECODER}
        missing = [name for name, asked in refused.items() if asked]
        if missing:  # vLLM's supports_* checks refuse these first; this guards direct use
            raise NotImplementedError(f"paged-backend does not support {', '.join(missing)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.softcap = logits_soft_cap or None  # (vLLM passes 0 or None for none)
        sinks = kwargs.get("sinks")  # [Hq] of this rank: a parameter loaded later, so read per call
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape [{num_heads}] (one per query head), got {list(sinks.shape)}")
        self.sinks = sinks

    def _caches(self, kv_cache: torch.Tensor):
        # vLLM's per-layer cache is [NB, Hkv, BS, 2D] (K and V side by side in the last dim):
        # [NB, BS, Hkv, D] views of it, no copy (any strides are accepted)
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value [T, Hkv, D] (may be padded past slot_mapping's length; -1 slots are skipped)."""
        k_cache, v_cache = self._caches(kv_cache)
        n = slot_mapping.shape[0]
        pb.write_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping)

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
        nd, ndt, t = md.num_decodes, md.num_decode_tokens, md.num_actual_tokens
        if nd:
            # decode row i is token i (a full graph's padding requests have no token and length 0:
            # their rows, padding tokens, get zeros; padding tokens past nd are left alone)
            q = query[:nd]
            if isinstance(md.plan, pb.CascadePlan):
                output[:nd] = pb.cascade_decode(q, k_cache, v_cache, md.plan, return_lse=False, scale=self.scale,
                                                softcap=self.softcap, sinks=sinks)
            else:
                pb.paged_decode(q, k_cache, v_cache, md.block_table[:nd], md.seq_lens[:nd], scale=self.scale,
                                plan=md.plan, return_lse=False, out=output[:nd], softcap=self.softcap, sinks=sinks)
        if md.num_prefills:
            output[ndt:t] = pb.paged_prefill(
                query[ndt:t], k_cache, v_cache, md.block_table[nd:], md.seq_lens[nd:], md.prefill_query_start_loc,
                causal=True, return_lse=False, scale=self.scale, query_start_loc_cpu=md.prefill_query_start_loc_host,
                softcap=self.softcap, sinks=sinks)
        return output
