"""Host-side scheduling for the paged backend: numpy only (no torch, no triton).

BlockManager   ref-counted KV block pool: prefix cache, fork + copy-on-write, numpy block tables
Scheduler      waiting/running queues, chunked prefill + decode, recompute preemption
ScheduledBatch per-step host arrays (block_tables, seq_lens, query_start_loc, slot_mapping, ...)
"""
from .block_manager import BlockManager
from .sampling_params import SamplingParams
from .batch import ScheduledBatch
from .scheduler import Scheduler
from .sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["BlockManager", "SamplingParams", "ScheduledBatch", "Scheduler", "Sequence",
           "SequenceGroup", "SequenceStatus"]
