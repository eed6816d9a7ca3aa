"""The paged-cache input builders now live in the package (``paged_backend.testing.inputs``,
docs/testing.md); re-exported here for the tests' imports."""
from paged_backend.testing.inputs import (make_block_table, make_cache, make_decode_inputs,  # noqa: F401
                                          make_fp8_cache, make_prefill_inputs, make_shared_prefix_table,
                                          misaligned, of_fused_rows, pad_table, poison_outside, strided)
