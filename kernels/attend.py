"""Device helpers shared by the paged attention kernels (decode, cascade nodes).

Scores live in the exp2 domain (``qk_scale = scale * log2(e)``); the state a kernel stores is
converted back to natural log by :func:`finish_state`. Logit soft-capping (``SOFTCAP``) maps a
score ``x = scale * q.k`` to ``softcap * tanh(x / softcap)``; kernels take ``cap = softcap * log2(e)``.
"""
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def fast_tanh(q: torch.Tensor) -> bool:
    """Whether kernels soft-cap with the hardware tanh: half-precision inputs on a GPU (fp32 keeps
    the exact formula, and the interpreter has no PTX)."""
    return q.is_cuda and q.dtype != torch.float32


def soft_cap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """The torch paths' soft-capping of natural-log scores (``softcap`` 0: none)."""
    return softcap * torch.tanh(s / softcap) if softcap > 0 else s


def dequantized(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The torch paths' read of cache values: fp32, times an fp8 cache's ``[1]`` scale (None: as is)."""
    x = x.float()
    return x if scale is None else x * scale.to(x.device)


def sink_states(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """The torch paths' attention sinks, in place: ``o [N, Hq, D]``, ``lse [N, Hq]`` fp32 (ln) of
    a row's keys -> the state whose softmax denominator also holds ``exp(sinks[h])`` (a key of
    logit ``sinks[h]`` and value 0)."""
    if sinks is not None:
        new = torch.logaddexp(lse, sinks.float())  # the sink is finite: an empty row gets lse = sink
        o.copy_(o.float() * torch.exp(lse - new)[..., None])
        lse.copy_(new)


def fp8_mma_f16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether bf16 queries over an fp8 cache run their GEMMs in fp16 (``mma_operand``): fp8 -> fp16
    is one conversion per two values on the GPU, fp8 -> bf16 is not, and decode over fp8 was
    bound by it (H100, B8x32K, best tiles: 284 us in bf16 (63% of copy bandwidth), 223 us in fp16)."""
    return k_cache.element_size() == 1 and q.dtype == torch.bfloat16


@triton.jit
def mma_operand(q, F16: tl.constexpr):
    """Queries as the GEMMs take them: with ``F16`` (bf16 over an fp8 cache) fp16, saturated to its
    finite range (bf16 has more range; fp16 holds bf16's 8 mantissa bits exactly), so every tile's
    fp8 keys and values convert to fp16 and the probabilities round to fp16, not bf16."""
    if F16:  # (one return: Triton wants one return type)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def scale_scores(s, qk_scale, cap, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    """Raw ``q.k`` -> exp2-domain scores, soft-capped when ``SOFTCAP`` (``cap = softcap * log2(e)``).
    ``FAST_TANH`` (fp16/bf16 on a GPU): the hardware's ``tanh.approx`` (relative error ~2^-11, below
    half-precision inputs' own), one instruction instead of an exp2 and a division."""
    if SOFTCAP:
        x = s * (qk_scale / cap)
        if FAST_TANH:
            return cap * tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                                   is_pure=True, pack=1)
        # cap * tanh(x) with tanh(x) = 1 - 2 / (e^(2x) + 1): exp2 only (the interpreter has no
        # tanh), and it saturates to +-cap for large |x| (e^(2x) -> inf or 0)
        return cap - 2.0 * cap / (tl.exp2(x * 2.8853900817779268) + 1.0)
    return s * qk_scale


@triton.jit
def attend_paged_tile(q, m_i, l_i, acc, k_ptr, v_ptr, page, tok, end, row_lo, kvh, offs_d, d_ok, qk_scale, cap,
                      stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                      BS: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
                      ROW_LO: tl.constexpr):
    """One online-softmax step of the rows ``q [M, BLOCK_D]`` over the tokens ``tok [N]`` whose
    pages are ``page [N]`` (any cache strides); tokens >= ``end`` are masked. Without ``ROW_LO`` the
    tile must hold at least one live token, so the running max is finite after the first step;
    with it, row ``i`` also masks tokens below ``row_lo [M]`` (sliding windows), and a row may
    have seen no key yet. -> updated (m_i [M], l_i [M], acc [M, BLOCK_D]) fp32."""
    t_ok = tok < end
    row = (tok % BS).to(tl.int64)
    page64 = page.to(tl.int64)
    kv_mask = t_ok[:, None] & d_ok[None, :]
    # (an fp8 cache's values are converted to q's dtype; its scales are applied by the caller)
    k = tl.load(k_ptr + (page64 * stride_kb + row * stride_ks + kvh * stride_kh)[:, None]
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE:  # fp32 inputs: no tf32 rounding
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if ROW_LO:
        ok = t_ok[None, :] & (tok[None, :] >= row_lo[:, None])
    else:
        ok = t_ok[None, :]
    s = tl.where(ok, scale_scores(s, qk_scale, cap, SOFTCAP, FAST_TANH), float("-inf"))  # [M, N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if ROW_LO:  # a row with no key yet keeps m = -inf: exponentiate against 0, not -inf (NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    pr = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    v = tl.load(v_ptr + (page64 * stride_vb + row * stride_vs + kvh * stride_vh)[:, None]
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pr.to(q.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(q.dtype), v)
    return m_new, l_i, acc


@triton.jit
def attend_paged_range(q, k_ptr, v_ptr, bt_row, start, end, bt_end, row_lo, kvh, offs_d, d_ok, qk_scale, cap,
                       stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                       stride_btn, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                       FAST_TANH: tl.constexpr, ROW_LO: tl.constexpr):
    """Attention of the rows ``q [BLOCK_M, BLOCK_D]`` over tokens ``[start, end)`` of one sequence,
    whose pages are in the block-table row ``bt_row``, ``BLOCK_N`` tokens a step. Page ids are read
    for tokens below ``bt_end >= end`` (within the row): a bound known before ``end`` is, so the
    first page load need not wait for it; ids past ``end`` are never dereferenced. ``ROW_LO``: row
    ``i`` attends only tokens ``>= row_lo [BLOCK_M]`` (see :func:`attend_paged_tile`).
    -> (o [BLOCK_M, BLOCK_D], lse [BLOCK_M]) as :func:`finish_state` gives them."""
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tok = start + offs_n
    page = tl.load(bt_row + (tok // BS) * stride_btn, mask=tok < bt_end, other=0)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        # Fetch the next tile's page ids now, so the K/V loads of the next iteration do not wait
        # on a dependent block-table load.
        nxt = tok + BLOCK_N
        page_next = tl.load(bt_row + (nxt // BS) * stride_btn, mask=nxt < bt_end, other=0)
        m_i, l_i, acc = attend_paged_tile(q, m_i, l_i, acc, k_ptr, v_ptr, page, tok, end, row_lo, kvh, offs_d, d_ok,
                                          qk_scale, cap, stride_kb, stride_ks, stride_kh, stride_kd,
                                          stride_vb, stride_vs, stride_vh, stride_vd, BS, IEEE, SOFTCAP, FAST_TANH,
                                          ROW_LO)
        page = page_next
    return finish_state(m_i, l_i, acc)


@triton.jit
def add_sink(o, lse, sink):
    """(o [M, D], lse [M] ln) -> the state with ``exp(sink [M])`` added to its softmax denominator
    (a key of logit ``sink`` and value 0); an empty row (lse -inf) gives o = 0, lse = sink."""
    new = tl.maximum(lse, sink) + tl.log(1.0 + tl.exp(-tl.abs(lse - sink)))  # logaddexp, sink finite
    return o * tl.exp(lse - new)[:, None], new


@triton.jit
def finish_state(m_i, l_i, acc):
    """(m_i, l_i, acc) in the exp2 domain -> (o [M, D], lse [M] natural log); rows that saw no
    key give o = 0, lse = -inf."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse
