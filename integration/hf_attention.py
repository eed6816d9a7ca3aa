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

import numpy as np
import torch

from paged_backend.kernels.decode_torch import cache_rows_torch, decode_chunk_torch, decode_chunks_torch
from paged_backend.kernels.dispatch import use_triton
from paged_backend.kernels.prefill_torch import prefill_chunk_torch, prefill_chunks_torch

ATTN_IMPLEMENTATION = "paged_backend"


@torch.compiler.disable  # a compiled model (integration/compiled.py) breaks its graphs here: our ops run as they are
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
    sinks = None if sinks is None else sinks.float()  # gpt-oss's per-head sinks
    if query.device.type == "cpu" and not kwargs.get("softcap"):
        out = cpu_attend(step, module.layer_idx, query, key, value, scaling, sinks, kwargs.get("sliding_window"))
        if out is not None:
            return out, None
    out = step.attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                      scaling, softcap=kwargs.get("softcap"),  # (Gemma 2's logit soft-capping, or None)
                      sinks=sinks,
                      window=kwargs.get("sliding_window"))  # (the layer's window, or None: full attention)
    return out.unsqueeze(0), None


def cpu_attend(step, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
               sinks: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """A decode or prefill step's attention on the CPU through the torch code of ``pb.write_kv``,
    ``pb.paged_decode`` and ``pb.paged_prefill`` called directly -> out [1, T, Hq, D], or None where
    the step does not qualify (an fp8 cache, a non-contiguous cache, a slot outside the cache, the
    Triton interpreter: then ``step.attend`` runs). Where each query's keys lie (and, in a prefill,
    which ones it sees) is worked out once per step and window (``decode_chunks_torch``,
    ``prefill_chunks_torch``), not in every layer, and the public ops' checks of inputs the engine
    made itself are skipped: a layer copies its new K/V rows into the cache, gathers the keys (a
    decode row whose blocks follow each other: none) and runs one fused attention op.
    SmolLM2-135M on 2 cores, a layer in the engine: decode ~330 -> ~50 us, a 32-token prefill
    ~1 ms -> ~0.2 ms (transformers' SDPA with its dense cache: ~40 and ~75 us)."""
    memo = step.__dict__.get("_cpu_attend")
    if memo is None:
        memo = step.__dict__["_cpu_attend"] = {} if _cpu_attend_qualifies(step, query) else False
    k_cache, v_cache = step.cache.k[layer], step.cache.v[layer]
    if memo is False or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    decode = step.kind == "decode"
    if decode:
        window = window if window in step.plans else None  # (a window no row outgrows: the full-attention keys)
    elif window is not None and window >= step.max_seq_len:
        window = None
    chunks = memo.get(window)
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if chunks is None:
        chunks = memo[window] = (
            decode_chunks_torch(step.block_table, step.seq_lens_cpu, bs, hkv * d, window or 0) if decode else
            prefill_chunks_torch(step.block_table, step.query_start_loc_cpu.tolist(), step.seq_lens_cpu.tolist(),
                                 query.shape[1], hkv, bs, causal=True, window=window or 0))
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)  # [NB * BS, Hkv, D]
    t = query.shape[2]
    # [T, Hkv, D] (one token: a view); write, then attend: the new keys are read
    kf.index_copy_(0, step.slot_mapping, key.view(1, hkv, d) if t == 1 else key[0].transpose(0, 1))
    vf.index_copy_(0, step.slot_mapping, value.view(1, hkv, d) if t == 1 else value[0].transpose(0, 1))
    q = query.view(1, -1, d) if t == 1 else query[0].transpose(0, 1)  # [T, Hq, D]
    scale = d ** -0.5 if scale is None else float(scale)
    if not decode:
        out = torch.empty(q.shape, dtype=torch.float32)
        for chunk in chunks:
            out.index_copy_(0, chunk.dst, prefill_chunk_torch(q, k_cache, v_cache, chunk, scale, sinks,
                                                              need_lse=False)[0])
    elif len(chunks) == 1:  # (every row has a key, so the chunks hold every row)
        _, n, keys, mask, empty = chunks[0]
        if type(keys) is tuple:  # one row whose blocks follow each other: its keys in place
            k, v = kf[keys[0]:keys[0] + keys[1]], vf[keys[0]:keys[0] + keys[1]]
        else:
            k, v = kf.index_select(0, keys), vf.index_select(0, keys)
        out = decode_chunk_torch(q, k, v, n, scale, mask, empty, sinks, need_lse=False)[0]
    else:
        out = torch.empty(q.shape, dtype=torch.float32)
        for c, n, keys, mask, empty in chunks:
            k, v = cache_rows_torch(k_cache, keys), cache_rows_torch(v_cache, keys)
            out[c:c + n] = decode_chunk_torch(q[c:c + n], k, v, n, scale, mask, empty, sinks, need_lse=False)[0]
    return (out if out.dtype is query.dtype else out.to(query.dtype)).unsqueeze(0)


def _cpu_attend_qualifies(step, query: torch.Tensor) -> bool:
    """Whether ``cpu_attend`` runs ``step`` (checked once, on its first layer, on host arrays)."""
    cache, lens, qsl = step.cache, step.seq_lens_cpu, step.query_start_loc_cpu
    k0, slots = cache.k[0], step.slot_mapping.numpy()
    return (step.kind in ("decode", "prefill") and not cache.scales and not use_triton(k0)
            and query.dtype is k0.dtype and lens is not None and qsl is not None and lens.size > 0
            and slots.size == query.shape[2] and slots.dtype == np.int64 and lens.min() > 0
            and slots.min() >= 0 and slots.max() < k0.shape[0] * k0.shape[1])


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
