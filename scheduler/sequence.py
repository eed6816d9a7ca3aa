"""A sequence (one prompt + one sample's output) and a group (one request: a prompt and its n
samples). Plain Python state; the block manager owns block tables and the scheduler owns status.
"""
from __future__ import annotations

import enum
import itertools
from typing import Sequence as _Seq

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 0   # holds no blocks (new, or preempted: re-prefilled on resume)
    RUNNING = 1   # holds blocks
    FINISHED = 2  # done; blocks freed


class Sequence:
    """A prompt and one sample's tokens after it: ``prompt`` (the samples forked from one sequence
    share this list: never changed in place) and ``out`` (this sample's own: generated tokens, and
    ``PENDING`` places of tokens in flight); ``token_ids`` is the two joined (a new list).

    Why two lists: ``fork`` makes a prompt's n samples at the end of its prefill, on the step loop's
    path, and a copy of the prompt each (63 copies of a 32K-token list: ~6 ms on the development
    box; the H200 showed 16.5-17.8 ms of GPU idle before the first decode step) bought nothing, as
    samples never change their prompt.

    num_computed_tokens: tokens whose KV is in the cache, or scheduled to be written by the step
    being built. In decode it is len(seq) - 1: the newest sampled token has no KV yet.
    block_table: physical block ids (list[int]); mirrored into the block manager's numpy table at
    row ``row``. num_hashed_blocks: leading full blocks already in (or taken from) the prefix cache.
    wait_for / prefill_after: a resumed sibling shares its leader's leading blocks and may only be
    prefilled once the leader has computed ``prefill_after`` tokens.
    """

    __slots__ = ("seq_id", "prompt", "out", "num_computed_tokens",
                 "block_table", "row", "num_hashed_blocks", "status", "finish_reason",
                 "group", "wait_for", "prefill_after")
    _counter = itertools.count()

    def __init__(self, token_ids: _Seq[int], num_prompt_tokens: int | None = None,
                 seq_id: int | None = None):
        self.seq_id = next(Sequence._counter) if seq_id is None else seq_id
        ids = list(token_ids)
        p = len(ids) if num_prompt_tokens is None else num_prompt_tokens
        self.prompt: list[int] = ids[:p]
        self.out: list[int] = ids[p:]
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.row = -1
        self.num_hashed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.group: SequenceGroup | None = None
        self.wait_for: Sequence | None = None
        self.prefill_after = 0

    def __len__(self) -> int:
        return len(self.prompt) + len(self.out)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
                f"{self.status.name})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @num_prompt_tokens.setter
    def num_prompt_tokens(self, n: int) -> None:
        """The first ``n`` tokens are the prompt from now on (the prompt list is this sequence's own then)."""
        ids = self.prompt + self.out
        self.prompt, self.out = ids[:n], ids[n:]

    @property
    def token_ids(self) -> list[int]:
        """The prompt and the sample's tokens (a new list: append with :meth:`append`)."""
        return self.prompt + self.out

    def tokens(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` (0 <= start <= end <= len), without joining the rest."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.out[start - p:end - p]
        return self.prompt[start:] + self.out[:end - p]

    @property
    def last_token(self) -> int:
        return self.out[-1] if self.out else self.prompt[-1]

    def append(self, token: int) -> None:
        self.out.append(token)

    def set_token(self, at: int, token: int) -> None:
        """Token ``at`` (a position after the prompt) is ``token``."""
        i = at - len(self.prompt)
        if i < 0:
            raise ValueError(f"position {at} is in the prompt ({len(self.prompt)} tokens), which samples share")
        self.out[i] = token

    @property
    def num_output_tokens(self) -> int:
        return len(self.out)

    @property
    def output_token_ids(self) -> list[int]:
        return self.out[:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def clone(self) -> "Sequence":
        """A new sequence (new id) with the same tokens (the prompt shared) and computed state,
        holding no blocks: the block manager's ``fork`` fills in the shared block table."""
        c = Sequence(())
        c.prompt, c.out = self.prompt, self.out[:]
        c.num_computed_tokens = self.num_computed_tokens
        c.num_hashed_blocks = self.num_hashed_blocks
        c.status = self.status
        c.group = self.group
        return c


class SequenceGroup:
    """One request: a prompt and its n samples.

    Before the prompt is prefilled the group holds one sequence; when its prefill ends the
    scheduler forks it into ``params.n`` sequences (``forked`` becomes True). ``seqs`` keeps
    finished samples too (their outputs are the request's result).
    """

    def __init__(self, request_id, prompt_token_ids: _Seq[int], params: SamplingParams,
                 arrival: int):
        self.request_id = request_id
        self.params = params
        self.arrival = arrival
        seq = Sequence(prompt_token_ids)
        seq.group = self
        self.seqs: list[Sequence] = [seq]
        self.forked = params.n == 1
        self.num_live = 1
        self.num_preemptions = 0

    def __repr__(self) -> str:
        return (f"SequenceGroup({self.request_id!r}, n={self.params.n}, live={self.num_live}, "
                f"forked={self.forked})")

    @property
    def is_finished(self) -> bool:
        return self.num_live == 0

    @property
    def num_seq_slots(self) -> int:
        """Sequences this group counts against ``max_num_seqs`` (n until it forks)."""
        return self.num_live if self.forked else self.params.n

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not SequenceStatus.FINISHED]

    @property
    def outputs(self) -> list[list[int]]:
        """Generated token ids of each sample, in sample order."""
        return [s.output_token_ids for s in self.seqs]

    @property
    def finish_reasons(self) -> list[str | None]:
        return [s.finish_reason for s in self.seqs]
