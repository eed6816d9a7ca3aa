"""paged-backend: paged-KV attention with Triton kernels.

Attention states are ``(o, lse)`` with ``lse`` in float32 natural log; see docs/api.md.

Subpackages (installed under this namespace; in the repository they are the top-level folders
``kernels/``, ``scheduler/`` and ``integration/``): ``paged_backend.kernels`` (Triton kernels and
their torch versions), ``paged_backend.scheduler`` (host scheduling, imports neither torch nor
Triton), ``paged_backend.integration`` (transformers plug-in, offline engine, CLI).

The ops below are imported on first use, so ``import paged_backend.scheduler`` needs no torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "write_kv": "cache", "copy_blocks": "cache",
    "paged_decode": "decode",
    "merge_states": "merge", "merge_states_many": "merge",
    "plan_decode": "decode_plan", "DecodePlan": "decode_plan",
    "plan_cascade": "cascade", "cascade_decode": "cascade", "CascadePlan": "cascade",
    "paged_prefill": "prefill",
}

__all__ = ["write_kv", "copy_blocks", "paged_decode", "plan_decode", "DecodePlan", "paged_prefill",
           "merge_states", "merge_states_many", "CascadePlan", "cascade_decode", "plan_cascade"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"paged_backend.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
