"""paged-backend as a vLLM attention backend (tested with vLLM 0.33.0).

    pip install "vllm==0.33.0"   # with its CUDA torch; paged-backend beside it
    vllm serve MODEL --attention-backend CUSTOM

The package registers itself through vLLM's ``vllm.general_plugins`` entry point (pyproject), so
``--attention-backend CUSTOM`` (or ``LLM(..., attention_config={"backend": "CUSTOM"})``) selects
:class:`~paged_backend.integration.vllm.backend.PagedAttentionBackend`. Modules: ``backend``
(what the backend supports), ``builder`` (per-step metadata and plans), ``impl`` (the per-layer
KV write and attention). docs/vllm.md has the details.
"""
BACKEND = "paged_backend.integration.vllm.backend.PagedAttentionBackend"


def register() -> None:
    """vLLM's general-plugin hook: registers the backend as ``AttentionBackendEnum.CUSTOM``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
