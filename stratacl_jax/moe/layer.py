"""The MoE layer built on dispatch and combine: a router, the experts' FFN,
the expert-parallel layer, and the same MoE on one device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import _ffi
from ._combine import combine
from ._common import LAYER, weight_dtype
from ._dispatch import dispatch

_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}


def _activation(activation):
    if callable(activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"{LAYER}: activation must be one of {tuple(_ACTIVATIONS)} or a callable, "
                         f"got {activation!r}") from None


def route(x, router_w, top_k: int, *, renormalize: bool = True):
    """Softmax top-k router: ``(weights [T, K], expert ids [T, K] int32)``.

    Probabilities are a softmax over all experts of ``x @ router_w``
    (float32, float64 for float64 inputs); with ``renormalize`` the k chosen
    ones are rescaled to sum to 1 (Mixtral's choice), otherwise they are the
    raw probabilities (Switch/GShard's)."""
    logits = (x @ router_w).astype(weight_dtype(jnp.result_type(x, router_w)))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, idx = lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, idx.astype(jnp.int32)


def expert_ffn(recv_x, w_in, w_out, activation="gelu"):
    """Every local expert's 2-layer FFN on its rows: ``[E_local, C, H] -> [E_local, C, H]``.
    Zero rows stay zero (no biases), so the padding costs nothing but flops."""
    act = _activation(activation)
    hidden = act(jnp.einsum("ech,ehf->ecf", recv_x, w_in))
    return jnp.einsum("ecf,efh->ech", hidden, w_out)


def check_layer(x, router_w, w_in, w_out, top_k, n):
    if x.ndim != 2:
        raise ValueError(f"{LAYER}: x must be [T, H], got shape {x.shape}")
    h = x.shape[1]
    if router_w.ndim != 2 or router_w.shape[0] != h:
        raise ValueError(f"{LAYER}: router_w must be [H, E] with H={h}, got shape {router_w.shape}")
    e = router_w.shape[1]
    if e % n:
        raise ValueError(f"{LAYER}: {e} experts are not divisible by the {n} ranks")
    el = e // n
    if w_in.ndim != 3 or w_in.shape[:2] != (el, h):
        raise ValueError(f"{LAYER}: w_in must be this rank's [E_local, H, F] = [{el}, {h}, F], got {w_in.shape}")
    if w_out.shape != (el, w_in.shape[2], h):
        raise ValueError(f"{LAYER}: w_out must be [E_local, F, H] = [{el}, {w_in.shape[2]}, {h}], got {w_out.shape}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{LAYER}: top_k must be in [1, {e}], got {top_k}")
    return e


def expert_parallel_ffn(x, router_w, w_in, w_out, *, axis_name, top_k: int, capacity: int,
                        activation="gelu", renormalize: bool = True):
    """A MoE FFN layer over the expert-parallel axis ``axis_name``, inside shard_map.

    x [T, H]: this rank's tokens; router_w [H, E] replicated; w_in [E_local, H, F]
    and w_out [E_local, F, H]: this rank's slice of the expert weights (sharded on
    the expert axis: rank r holds experts r*E_local ...). Softmax top-k routing
    (renormalised over the chosen k unless ``renormalize=False``), dispatch with
    ``capacity`` rows per expert, ``activation`` ("gelu" (tanh form), "relu" or a
    callable) between the two matmuls, combine weighted by the router. Returns
    y [T, H]; pairs dropped for capacity contribute 0."""
    x = jnp.asarray(x)
    axes = _ffi.normalize_axes(axis_name, LAYER)
    e = check_layer(x, router_w, w_in, w_out, top_k, _ffi.Group(LAYER, axes).size)
    weights, idx = route(x, router_w, top_k, renormalize=renormalize)
    recv_x, handle = dispatch(x, idx, axis_name=axes, num_experts=e, capacity=capacity)
    return combine(expert_ffn(recv_x, w_in, w_out, activation), handle, weights)



def dense_moe_ffn(x, router_w, w_in, w_out, *, top_k: int, activation="gelu", renormalize: bool = True):
    """The same MoE on one device with no capacity limit: every token through
    its top-k experts, weighted. x [T, H]; w_in [E, H, F]; w_out [E, F, H]
    (all experts). For tests: it evaluates every expert on every token."""
    weights, idx = route(x, router_w, top_k, renormalize=renormalize)
    t = x.shape[0]
    gates = jnp.zeros((t, router_w.shape[1]), weights.dtype).at[jnp.arange(t)[:, None], idx].add(weights)
    act = _activation(activation)
    out = jnp.einsum("tef,efh->teh", act(jnp.einsum("th,ehf->tef", x, w_in)), w_out)
    return jnp.einsum("te,teh->th", gates.astype(out.dtype), out)
