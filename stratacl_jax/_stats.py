"""Counters from the C++ runtime."""
from __future__ import annotations

import warnings

from . import _core
from . import _lax_routing

# STRATA_REDUCE_ISA is read when the extension loads; a name it could not
# honour (unknown, not built, or not supported by this CPU) left a note.
if _core.reduce_isa_note():
    warnings.warn(_core.reduce_isa_note(), RuntimeWarning, stacklevel=2)


def stats() -> dict:
    """bytes_exchanged (written by transfers between ranks, either mode; MoE:
    one row per (token, destination rank) each way, DeepEP's rule),
    bytes_direct (those moved straight between user buffers: strata mode),
    bytes_staged (copied into or out of comm buffers: buffer_centric mode),
    bytes_local (MoE: dispatch's fan-out of a received token to the rank's
    other experts, and combine's sum of a token's rows on their rank before
    one row goes back), registrations, registry hits/misses,
    core_bytes[npu][core] and sdma_bytes[npu][engine] (bytes each lane read +
    wrote), staged_bytes[npu] (the plan ops' buffer_centric copies; MoE's
    staging is in bytes_staged only), among others;
    reduce_isa: the instruction set of the reduction kernels in use
    ("baseline", "avx2" or "avx512": the widest the CPU runs, or
    STRATA_REDUCE_ISA's choice); lax_routed / lax_left_to_xla: jax.lax
    collectives traced under config(lax_collectives="strata"), by primitive,
    that went to strata or stayed on XLA (with the reason)."""
    return {**_core.stats(), **_lax_routing.counters()}


def reset_stats() -> None:
    _core.reset_stats()
    _lax_routing.reset()
