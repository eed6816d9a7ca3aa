"""paged-backend: paged-KV attention with Triton kernels.

Attention states are ``(o, lse)`` with ``lse`` in float32 natural log; see docs/api.md.
"""
from paged_backend.cache import copy_blocks, write_kv
from paged_backend.decode import paged_decode
from paged_backend.merge import merge_states, merge_states_many
from paged_backend.plan import DecodePlan, plan_decode
from paged_backend.cascade import CascadePlan, cascade_decode, plan_cascade
from paged_backend.prefill import paged_prefill

__all__ = ["write_kv", "copy_blocks", "paged_decode", "plan_decode", "DecodePlan", "paged_prefill",
           "merge_states", "merge_states_many", "CascadePlan", "cascade_decode", "plan_cascade"]
