"""Gumbel-max draws with counter-based noise: the engine's sampling primitive.

``gumbel_argmax(x, keys, vocab_hash)`` -> for each row ``s`` of scaled and filtered logits
``x [S, V]`` fp32, the token ``argmax_v x[s, v] + g[s, v]`` with Gumbel noise
``g = -log(-log(u))``, ``u = ((h >> 9) + 0.5) / 2^23``, ``h = mix32(keys[s] ^ vocab_hash[v])``.
The noise is a function of the row's key and the token id only (no generator state), so a draw
does not depend on the batch it runs in. ``u`` takes 2^23 equally likely values, each exact in
fp32 and strictly inside (0, 1), so the noise is finite: with 24 bits the last bucket's
``2^24 - 0.5`` rounds to ``2^24``, ``u`` to 1 and the noise to +inf, and that token won whatever
its logit (a filtered token too: ``-inf + inf`` is NaN, which ``argmax`` picks). Ties go to the lowest token id. Triton (one fused pass,
``kernels/gumbel.py``) on CUDA tensors and under ``TRITON_INTERPRET=1``; the torch version below
elsewhere, with the same bits on the GPU (libdevice's ``logf`` is torch's CUDA ``log``).

``gumbel_sample(logits, temperature, keys, vocab_hash)`` is the engine's whole draw for rows with a
temperature and no filters, in one pass over the raw logits (any float dtype): the tokens of
``gumbel_argmax(logits.float() / temperature[:, None], ...)`` and their raw log-probabilities
(``log_softmax(logits.float())`` at the token; natural log).
"""
from __future__ import annotations

import numpy as np
import torch

from paged_backend.kernels.checks import check_tensor
from paged_backend.kernels.dispatch import use_triton

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def mix32(x):
    """murmur3's 32-bit finaliser on uint32 values (numpy uint32 arrays, or int64 tensors holding
    values in [0, 2^32): products wrap, and only their low 32 bits are kept)."""
    if isinstance(x, np.ndarray):
        x = x.astype(np.uint32)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
        return x
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def vocab_hash(vocab_size: int, device) -> torch.Tensor:
    """[V] int64: each token id's hash, mixed with a row's key for its noise."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32((ids * GOLDEN) & M32)


def _check(name: str, x: torch.Tensor, dtypes, keys: torch.Tensor, vocab_hash: torch.Tensor) -> None:
    check_tensor(name, x, ndim=2, dtypes=dtypes)
    s, v = x.shape
    check_tensor("keys", keys, ndim=1, dtypes=(torch.int64,), device=x.device)
    check_tensor("vocab_hash", vocab_hash, ndim=1, dtypes=(torch.int64,), device=x.device)
    if keys.shape[0] != s or vocab_hash.shape[0] != v:
        raise ValueError(f"keys must have {s} entries and vocab_hash {v} ({name} is {tuple(x.shape)}), got "
                         f"{tuple(keys.shape)} and {tuple(vocab_hash.shape)}")
    if v == 0 and s:
        raise ValueError(f"{name} must have at least one column (token) to draw from")


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """x [S, V] fp32 (-inf where filtered), keys [S] int64 in [0, 2^32), vocab_hash [V] int64 (as
    :func:`vocab_hash` makes it), all on one device -> tokens [S] int64 (see the module doc)."""
    _check("x", x, (torch.float32,), keys, vocab_hash)
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    if use_triton(x):
        from paged_backend.kernels.gumbel import gumbel_argmax_triton
        return gumbel_argmax_triton(x.contiguous(), keys, vocab_hash)
    return gumbel_argmax_torch(x, keys, vocab_hash)


def gumbel_argmax_torch(x: torch.Tensor, keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """The same draw with torch ops on [S, V] tensors."""
    h = mix32(keys[:, None] ^ vocab_hash[None, :])
    u = ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))  # exact in fp32, in [2^-24, 1 - 2^-24]
    return torch.argmax(x - torch.log(-torch.log(u)), dim=-1)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  vocab_hash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] fp32/fp16/bf16 (raw: no filter), temperature [S] fp32 (each > 0), keys and
    vocab_hash as for :func:`gumbel_argmax` -> (tokens [S] int64, logprobs [S] fp32): the draw of
    ``gumbel_argmax(logits.float() / temperature[:, None], keys, vocab_hash)`` (the same tokens,
    bitwise on the GPU) and each token's raw log-probability, in one pass over the logits."""
    _check("logits", logits, (torch.float32, torch.float16, torch.bfloat16), keys, vocab_hash)
    s = logits.shape[0]
    check_tensor("temperature", temperature, ndim=1, dtypes=(torch.float32,), device=logits.device)
    if temperature.shape[0] != s:
        raise ValueError(f"temperature must have {s} entries (one per row of logits), got {temperature.shape[0]}")
    if s == 0:
        return torch.zeros(0, dtype=torch.int64, device=logits.device), torch.zeros(0, device=logits.device)
    if use_triton(logits):
        from paged_backend.kernels.gumbel import gumbel_sample_triton
        return gumbel_sample_triton(logits if logits.stride(1) == 1 else logits.contiguous(), temperature.contiguous(),
                                    keys.contiguous(), vocab_hash)
    return gumbel_sample_torch(logits, temperature, keys, vocab_hash)


def gumbel_sample_torch(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                        vocab_hash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same draw with torch ops on [S, V] tensors."""
    x = logits.float()
    tokens = gumbel_argmax_torch(x / temperature[:, None], keys, vocab_hash)
    return tokens, x.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
