"""Turning what a user passes to ``LLM.generate`` / ``LLM.chat`` into checked requests, before
anything runs: every malformed prompt or parameter raises with its index named."""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np

from paged_backend.scheduler import SamplingParams


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams  # with the model's EOS added to stop_token_ids (unless ignore_eos)
    seed: int


@dataclasses.dataclass
class RequestMaker:
    """What checking prompts needs from the engine: its tokenizer (or None), vocabulary size, EOS
    ids, the generator that seeds requests without a seed, and the next automatic request id."""
    tokenizer: object
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    seeds: np.random.Generator
    next_id: int = 0

    def make(self, prompts, sampling_params, request_ids=None) -> list[Request]:
        """prompts: a str, ``{"prompt": str}``, ``{"prompt_token_ids": [int]}`` or a list of those;
        sampling_params: one ``SamplingParams`` for all, one per prompt, or None (defaults)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if isinstance(sampling_params, (str, bytes, Mapping)) or not isinstance(sampling_params, Iterable):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"request_ids has {len(request_ids)} entries for {len(prompts)} prompts")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            text, ids = self._tokens(p, i)
            if not sp.ignore_eos and self.eos_token_ids:
                sp = dataclasses.replace(sp, stop_token_ids=tuple(dict.fromkeys(sp.stop_token_ids + self.eos_token_ids)))
            if sp.stop and self.tokenizer is None:
                raise ValueError(f"sampling_params[{i}].stop needs a tokenizer (stop strings are matched on text)")
            rid = str(request_ids[i]) if request_ids is not None else f"{self.next_id + i}"
            seed = sp.seed if sp.seed is not None else int(self.seeds.integers(0, 2 ** 63))
            reqs.append(Request(rid, text, ids, sp, seed))
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ValueError("request_ids must be distinct")
        self.next_id += len(prompts)
        return reqs

    def _tokens(self, p, i: int) -> tuple[str | None, list[int]]:
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompts[{i}] is empty")
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}] is text but the engine has no tokenizer: pass prompt_token_ids")
            return p, list(self.tokenizer(p).input_ids)
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                ids = p["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in ids):
                    raise TypeError(f"prompts[{i}]['prompt_token_ids'] must be a list of ints")
                if not ids:
                    raise ValueError(f"prompts[{i}] has no tokens")
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompts[{i}] has token ids outside the vocabulary [0, {self.vocab_size}): "
                                     f"{bad[:5]}")
                return p.get("prompt"), list(ids)
            if "prompt" in p:
                return self._tokens(p["prompt"], i)
            raise ValueError(f"prompts[{i}] must have 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
        raise TypeError(f"prompts[{i}] must be a str or a dict, got {type(p).__name__}")


def chat_prompts(tokenizer, model_name: str, messages, *, add_generation_prompt: bool = True,
                 chat_template_kwargs: dict | None = None) -> list[dict]:
    """Conversations (a list of ``{"role", "content"}`` dicts, or a list of them) -> prompts with
    the chat template's text and its token ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name} has no chat template; send raw prompts with generate()")
    one = bool(messages) and isinstance(messages[0], dict)
    convs = [messages] if one else list(messages)
    out = []
    for i, conv in enumerate(convs):
        if not conv or isinstance(conv, (str, dict)):
            raise ValueError(f"messages[{i}] must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
        for j, m in enumerate(conv):
            at = f"messages[{j}]" if one else f"messages[{i}][{j}]"
            if not isinstance(m, dict):
                raise ValueError(f"{at} must be a {{'role': ..., 'content': ...}} dict, got {type(m).__name__}")
            for key in ("role", "content"):
                if key not in m:
                    raise ValueError(f"{at} has no {key!r} (a message is a {{'role': ..., 'content': ...}} dict)")
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))
        out.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
    return out
