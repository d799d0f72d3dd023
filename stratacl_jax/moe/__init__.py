"""strata.moe — expert-parallel MoE dispatch and combine, and a ready MoE layer.

``E`` experts are spread evenly over the ranks of ``axis_name`` (``N`` ranks,
``E_local = E // N``; expert ``e`` lives on rank ``e // E_local``). Inside
``jax.shard_map``, on each rank::

    recv_x, handle = strata.moe.dispatch(x, topk_idx, axis_name="ep",
                                         num_experts=E, capacity=C)
    expert_y = my_experts(recv_x)                 # [E_local, C, H]
    y = strata.moe.combine(expert_y, handle, topk_weights)

The runtime computes the layout from every rank's routing when the group
meets (pairs per expert per source rank, prefix sums, the row of every
(token, k) pair). Then, as DeepEP does, a token crosses to each destination
rank once, however many of its experts live there: from the source rank's
``x`` into the owner's ``recv_x`` row of the token's first pair (lowest k) on
that rank, and from there into the rows of its other pairs on the same rank.
Combine sums a token's rows from one rank's experts on that rank and sends one
partial row back per (token, rank). Rows of an expert are ordered by (source
rank, source token, k); pairs past ``capacity`` are dropped and counted in
``handle.dropped`` on their source rank.

Also here: ``expert_parallel_ffn`` (a drop-in MoE FFN layer built on them),
``reference_expert_parallel_ffn`` (the same layer written the usual JAX way,
``lax.all_to_all`` of padded ``[N, E_local, capacity, H]`` buffers, the peer in
tests and benchmarks) and ``dense_moe_ffn`` (single-device, no capacity).

dispatch and combine are JAX primitives like the collectives (abstract
evaluation, lowering to the runtime's FFI targets, batching as a sequence of
exchanges, JVP and transpose rules): ``_dispatch`` and ``_combine`` hold them
(combine's with its backward op), ``_across`` the path over axes that cross
processes, then ``layer`` and ``reference``; ``_common`` below them all.
"""
from ._combine import combine
# The backward op on its own: tests/test_moe_traffic.py measures its traffic.
from ._combine import _combine_bwd  # noqa: F401
from ._common import COMBINE, DISPATCH, LAYER, DispatchHandle
from ._dispatch import dispatch
from .layer import dense_moe_ffn, expert_ffn, expert_parallel_ffn, route
from .reference import reference_combine, reference_dispatch, reference_expert_parallel_ffn

__all__ = ["dispatch", "combine", "DispatchHandle", "route", "expert_ffn", "expert_parallel_ffn", "dense_moe_ffn",
           "reference_dispatch", "reference_combine", "reference_expert_parallel_ffn", "DISPATCH", "COMBINE", "LAYER"]
