"""What the engine returns: vLLM's offline output shapes, plus a run's statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request.

    text: the generated text (special tokens skipped), ending before the first stop string;
    token_ids: the generated ids (a stop token id or the token that completed a stop string is
    kept); cumulative_logprob: the sum of the sampled tokens' log-probabilities under the model
    (raw logits, before temperature and filters); logprobs: with ``SamplingParams(logprobs=k)``, per
    generated token a dict ``{token id: log-probability}`` of the top k tokens and the sampled one;
    finish_reason: "stop" (a stop token, EOS or stop string) or "length" (max_tokens or
    max_model_len); stop_reason: the stop string or stop token id that ended it, else None.
    """
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """One request: its prompt and ``n`` samples (``outputs``, by sample index).

    ``error`` is set (and ``outputs`` empty) for a request the engine could not run at all, e.g.
    one that needs more KV blocks than the pool holds; the other requests of the call still run.
    ``num_preemptions``: how often the request was preempted (its KV freed, recomputed later).
    """
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    num_preemptions: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunStats:
    """Totals of one ``generate`` call (the CLI prints them as its summary).

    Times in seconds: ``prefill_time`` is the time of steps that ran prompt tokens (they may carry
    decodes too), ``decode_time`` of decode-only steps. ``peak_kv_blocks``: most blocks in use at
    once; ``peak_shared_bytes``: most KV bytes that sharing (prefix cache hits and forked samples
    reading one prompt copy) saved at once, against every sequence holding its own copy.
    """
    num_requests: int = 0
    num_rejected: int = 0
    num_samples: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    cascade_steps: int = 0
    ahead_steps: int = 0  # steps launched before the previous step's tokens were back
    graph_captures: int = 0  # steps that captured a CUDA graph first (cascade steps of a new plan shape)
    prefill_time: float = 0.0
    decode_time: float = 0.0
    wall_time: float = 0.0
    peak_kv_blocks: int = 0
    num_kv_blocks: int = 0
    kv_block_bytes: int = 0
    peak_shared_bytes: int = 0
    preemptions: int = 0
    step_log: list[dict] = field(default_factory=list)  # with LLM(profile=True): per step kind, rows,
    # tokens, host_s (until every kernel was queued), total_s (until the tokens were on the host), gpu_s
    # (GPU clock from just before its model ran - once planned - to after its draw), idle_s (from the last
    # step's end to this one's start: the GPU waiting for the host, the step's input copies included; None
    # first)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def summary(self) -> str:
        """A few lines for a terminal."""
        mib = 1 << 20
        lines = [
            f"requests   {self.num_requests} ({self.num_samples} samples)"
            + (f", {self.num_rejected} rejected" if self.num_rejected else ""),
            f"tokens     {self.prompt_tokens} prompt ({self.cached_prompt_tokens} from the prefix cache), "
            f"{self.generated_tokens} generated",
            f"time       {self.wall_time:.2f} s: prefill {self.prefill_time:.2f} s, decode {self.decode_time:.2f} s "
            f"({self.steps} steps, {self.decode_steps} decode-only, {self.cascade_steps} cascade, "
            f"{self.ahead_steps} run ahead)",
            f"speed      {self.tokens_per_s:.1f} generated tokens/s",
            f"KV cache   peak {self.peak_kv_blocks} of {self.num_kv_blocks} blocks "
            f"({self.peak_kv_blocks * self.kv_block_bytes / mib:.1f} MiB); sharing saved up to "
            f"{self.peak_shared_bytes / mib:.1f} MiB (prefix cache + forked samples)"
            + (f"; {self.preemptions} preemptions" if self.preemptions else ""),
        ]
        return "\n".join(lines)
