"""The transformers plug-in: an attention function registered with transformers'
``AttentionInterface`` under :data:`ATTN_IMPLEMENTATION`, and the model features it refuses.

A model loaded with ``attn_implementation="paged_backend"`` keeps its own embeddings, projections,
RoPE, norms and MLP; every attention call comes here with the step's metadata as the keyword
``paged_step`` (a :class:`paged_backend.integration.step.Step`)::

    model(input_ids=step.input_ids, position_ids=step.positions, logits_to_keep=step.logits_indices,
          use_cache=False, paged_step=step)

``input_ids [1, T]`` packs every row of the step (prefill chunks and decodes); the function writes
the layer's new K/V into the paged cache and attends through the step's op (vLLM's order: write,
then attend). The model is run with ``use_cache=False`` and no mask function is registered for the
name, so transformers builds neither a dense cache nor a ``[T, T]`` mask: the paged cache and the
packing live in the step (transformers' ``Cache`` interface assumes dense per-layer tensors).
"""
from __future__ import annotations

import torch

ATTN_IMPLEMENTATION = "paged_backend"


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (after RoPE and any q/k norm) -> (out [1, T, Hq, D], None)."""
    step = kwargs.get("paged_step")
    if step is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs inside paged_backend's engine: call the "
                           "model with paged_step=<Step> (see paged_backend.integration.step), or use LLM(...)")
    if kwargs.get("is_causal", True) is False or attention_mask is not None:
        raise NotImplementedError(f"{type(module).__name__} (layer {module.layer_idx}) asks for a non-causal or "
                                  "masked attention; the paged backend runs causal attention over packed rows")
    if query.shape[0] != 1:
        raise ValueError(f"query must pack every row into one batch row ([1, Hq, T, D]), got {tuple(query.shape)}")
    sinks = kwargs.get("s_aux")
    out = step.attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                      scaling, softcap=kwargs.get("softcap"),  # (Gemma 2's logit soft-capping, or None)
                      sinks=None if sinks is None else sinks.float(),  # gpt-oss's per-head sinks
                      window=kwargs.get("sliding_window"))  # (the layer's window, or None: full attention)
    return out.unsqueeze(0), None


def register() -> None:
    """Registers :func:`paged_attention` under :data:`ATTN_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention layers (modules with a ``layer_idx`` whose class is an Attention)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]


def layer_windows(model: torch.nn.Module) -> set[int | None]:
    """The sliding windows the layers pass to attention, None for a full-attention layer: a module's
    own ``sliding_window`` (Qwen2, Gemma 2/3, gpt-oss: None on full-attention layers), else its
    config's (Mistral, Phi-3)."""
    found = set()
    for m in attention_modules(model):
        w = m.sliding_window if hasattr(m, "sliding_window") else getattr(getattr(m, "config", None),
                                                                            "sliding_window", None)
        found.add(None if w is None else int(w))
    return found


def unsupported_features(model: torch.nn.Module) -> list[str]:
    """What a loaded causal LM needs that the paged backend lacks, one phrase per feature (empty if
    none). Sliding windows, soft-capping and sinks are run."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    found = []
    if not getattr(type(model), "is_backend_compatible", lambda: False)():
        found.append(f"{type(model).__name__} does not route attention through transformers' AttentionInterface")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        found.append("cross-attention (encoder-decoder)")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        found.append("ALiBi position biases")
    other = sorted({t for t in getattr(config, "layer_types", None) or ()
                    if t not in ("full_attention", "sliding_attention")})
    if other:
        found.append(f"layer types {other}")
    for m in attention_modules(model):
        if getattr(m, "is_causal", True) is False:
            found.append(f"non-causal attention ({type(m).__name__})")
            break
    return found
