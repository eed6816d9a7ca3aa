"""The backend class: what paged-backend supports, answered through vLLM's hooks, so vLLM's own
checks refuse a model that needs more (with the reason) instead of running it wrong."""
from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType

from paged_backend.kernels.checks import HEAD_DIMS


class PagedAttentionBackend(AttentionBackend):
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    # fp8 caches: vLLM allocates uint8 and passes per-tensor k/v scales (the impl views them as fp8)
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
    # vLLM calls impl.do_kv_cache_update (pb.write_kv) before impl.forward
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry member vllm.general_plugins registers us as

    @staticmethod
    def get_impl_cls():
        from .impl import PagedAttentionImpl
        return PagedAttentionImpl

    @staticmethod
    def get_builder_cls():
        from .builder import PagedMetadataBuilder
        return PagedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [1 << i for i in range(9)]  # the kernels take any power-of-two page up to 256 rows

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_DIMS)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER  # causal self-attention over the paged cache only

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8  # bf16 tensor cores (Ampere and later); tested on Hopper

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # decode/cascade plans per window, prefill skipping tiles outside it

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # per-head sinks (gpt-oss) in the softmax denominator of every path

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the decode/prefill split and the prefill rows' host offsets come from the CPU copy

    # Left at vLLM's default False, each refusing what we lack: supports_rswa, supports_alibi_sqrt, supports_mm_prefix, supports_non_causal, is_sparse, is_mla,
    # supports_per_head_quant_scales. supports_batch_invariance stays False too: a stream-K plan cuts
    # a request's KV by what else is in the batch, so its rounding depends on the batch (the result
    # is deterministic for a given batch). supports_dcp stays False: not wired yet.
