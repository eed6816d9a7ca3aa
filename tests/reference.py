"""The dense fp64 references and state comparison now live in the package
(``paged_backend.testing``, docs/testing.md); re-exported here for the tests' imports."""
from paged_backend.testing.compare import LSE_TOL, TOL, assert_close_state, check_state, rel_err  # noqa: F401
from paged_backend.testing.reference import (attend, cascade_reference, decode_reference, dequantize,  # noqa: F401
                                             gather_kv, prefill_reference)
