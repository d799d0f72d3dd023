"""A DeepSeek-V3/R1-shaped MoE transformer written once in JAX with strata ops, usable at two sizes.

The model: MLA attention (low-rank q and kv, a shared rope key, the latent KV cache), RMSNorm,
SwiGLU FFNs, first ``n_dense_layers`` dense, the rest MoE (sigmoid or softmax router, top-k via
``lax.top_k``, weights normalised over the k, one shared expert computed locally on each rank and
added to the routed output). ``deepseek_v3()`` is the public config.json shape (61 layers, hidden
7168, 256 routed experts top-8, 128 heads, KV LoRA rank 512, vocab 129280); ``tiny()`` is a small
float32 model with the same structure.

Parallelism: one mesh axis (default ``"ep"``) of N ranks. Attention, dense layers, the shared
expert, the embedding and the LM head are data parallel (weights replicated, batch split over the
ranks). Routed experts are expert parallel: their weights are stacked ``[E_slots, ...]`` and
sharded over the axis; tokens reach them with ``strata.moe.dispatch``, run batched on
``recv_x [E_local, C, H]`` and come back with ``strata.moe.combine``.

Used at two sizes with the same functions:

* **Run for real** at ``tiny()`` on a few emulated NPUs (``strata.emulator.make_mesh((8,),
  ("ep",))``): ``fn, specs = decode_step(cfg, mesh, ...)``; ``jax.jit(fn)(params, ...)``, and the
  values (and, for ``train_step``, the gradients) match the single-device ``reference_*`` functions
  (plain jnp, no capacity, every routed pair kept; tests/test_deepseek.py).
* **Traced, never executed** at ``deepseek_v3()`` on an abstract mesh of 128-320 ranks:
  ``jax.jit(fn).trace(*specs).jaxpr`` takes seconds, because the layers run as two ``lax.scan``s
  over stacked per-layer parameters (one for the dense layers, one for the MoE layers) and nothing
  data dependent happens in Python. That jaxpr is what a step simulator walks.

Parameters (``param_specs`` / ``param_pspecs`` / ``init_params``): a dict with ``embed [V, H]``,
``final_norm [H]``, ``lm_head [H, V]``, ``dense`` (every leaf ``[n_dense_layers, ...]``) and ``moe``
(every leaf ``[n_moe_layers, ...]``; the routed experts ``moe.experts.* [n_moe_layers, E_slots,
...]`` are the only sharded leaves, ``P(None, axis)``). With ``param_dtype="int8"`` every matmul
weight is ``{"w": int8, "s": float32 per output channel}`` and every matmul quantizes its
activation per token to int8 and runs ``dot_general(int8, int8) -> int32`` (W8A8, as
CloudMatrix-Infer serves DeepSeek-R1); the router stays float32, norms and the embedding stay in
the activation dtype.

Not modelled (they do not change the communication pattern): DeepSeek-V3's group-limited
routing and router bias, YaRN rope scaling, multi-token prediction; ``dispatch`` sends the
activation dtype (CloudMatrix-Infer quantizes to int8 before dispatch).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata

_F32 = jnp.float32
_NEG = -1e30  # masked attention score (finite: a fully masked row never appears, but no NaN if it did)


# ------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Config:
    """Sizes and dtypes of the model (defaults: DeepSeek-V3's public config.json)."""

    vocab: int = 129280
    hidden: int = 7168
    n_layers: int = 61
    n_dense_layers: int = 3
    dense_ffn: int = 18432
    n_experts: int = 256          # routed experts
    top_k: int = 8
    expert_ffn: int = 2048
    n_shared_experts: int = 1     # shared expert FFN = n_shared_experts * expert_ffn
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    rope_head_dim: int = 64
    nope_head_dim: int = 128
    v_head_dim: int = 128
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    router_score: str = "sigmoid"  # or "softmax"
    routed_scaling_factor: float = 2.5
    capacity_factor: float = 1.25
    param_dtype: str = "bfloat16"  # "bfloat16", "float32" or "int8" (W8A8)
    act_dtype: str = "bfloat16"    # "bfloat16" or "float32"

    def __post_init__(self):
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]")
        if self.param_dtype not in ("bfloat16", "float32", "int8"):
            raise ValueError(f"param_dtype must be bfloat16, float32 or int8, got {self.param_dtype!r}")
        if self.act_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"act_dtype must be bfloat16 or float32, got {self.act_dtype!r}")
        if self.router_score not in ("sigmoid", "softmax"):
            raise ValueError(f"router_score must be sigmoid or softmax, got {self.router_score!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim must be even, got {self.rope_head_dim}")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def shared_ffn(self) -> int:
        return self.n_shared_experts * self.expert_ffn

    @property
    def qk_head_dim(self) -> int:
        return self.nope_head_dim + self.rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Width of one MLA latent cache entry: the normalised KV latent and the roped key."""
        return self.kv_lora_rank + self.rope_head_dim

    @property
    def quantized(self) -> bool:
        return self.param_dtype == "int8"

    @property
    def act(self):
        return jnp.dtype(self.act_dtype)

    @property
    def float_param(self):
        """dtype of the parameters that are not int8 matmul weights (norms, embedding)."""
        return self.act if self.quantized else jnp.dtype(self.param_dtype)


def deepseek_v3(**overrides) -> Config:
    """DeepSeek-V3 / R1 (671B total, 37B active): the public config.json shape."""
    return dataclasses.replace(Config(), **overrides)


def tiny(**overrides) -> Config:
    """The same structure at toy size, float32: runs for real on 8 emulated NPUs in seconds."""
    base = Config(vocab=128, hidden=64, n_layers=3, n_dense_layers=1, dense_ffn=96, n_experts=16,
                  top_k=2, expert_ffn=32, n_shared_experts=1, n_heads=4, q_lora_rank=32,
                  kv_lora_rank=16, rope_head_dim=8, nope_head_dim=16, v_head_dim=16,
                  routed_scaling_factor=1.0, param_dtype="float32", act_dtype="float32")
    return dataclasses.replace(base, **overrides)


def expert_slots(cfg: Config, n_ranks: int) -> int:
    """E_slots = ceil(E / N) * N. Slots >= E are never routed to (the router has E outputs): at
    N=320 the 256 routed experts take one slot on each of 256 ranks and 64 slots stay idle here;
    the published EP320 deployment fills them with shared-expert and redundant expert replicas."""
    return -(-cfg.n_experts // n_ranks) * n_ranks


def default_capacity(cfg: Config, n_ranks: int, tokens_per_rank: int) -> int:
    """ceil(capacity_factor * N * T_local * K / E) rows per expert slot and dispatch."""
    return max(1, math.ceil(cfg.capacity_factor * n_ranks * tokens_per_rank * cfg.top_k / cfg.n_experts))


# ------------------------------------------------------------------------------------------------
# parameters


@dataclass(frozen=True)
class _Leaf:
    shape: tuple
    kind: str            # "matmul" (quantizable), "norm", "embed", "router"
    contract: int = 0    # matmul weights: the contracted (input) axis; the scale is per output channel
    expert: bool = False  # sharded over the expert axis (axis 1, after the layer axis)


def _layout(cfg: Config, n_ranks: int) -> dict:
    h, ld, lm = cfg.hidden, cfg.n_dense_layers, cfg.n_moe_layers

    def mm(*shape, contract=1, expert=False):
        return _Leaf(tuple(shape), "matmul", contract, expert)

    def norm(*shape):
        return _Leaf(tuple(shape), "norm")

    def attn(n):
        return {"wq_a": mm(n, h, cfg.q_lora_rank), "q_norm": norm(n, cfg.q_lora_rank),
                "wq_b": mm(n, cfg.q_lora_rank, cfg.n_heads * cfg.qk_head_dim),
                "wkv_a": mm(n, h, cfg.cache_dim), "kv_norm": norm(n, cfg.kv_lora_rank),
                # wkv_b of the checkpoint, split into its key and value halves (W_uk, W_uv)
                "w_uk": mm(n, cfg.kv_lora_rank, cfg.n_heads, cfg.nope_head_dim),
                "w_uv": mm(n, cfg.kv_lora_rank, cfg.n_heads, cfg.v_head_dim),
                "wo": mm(n, cfg.n_heads * cfg.v_head_dim, h)}

    def ffn(n, f):
        return {"w_gate": mm(n, h, f), "w_up": mm(n, h, f), "w_down": mm(n, f, h)}

    es, fe = expert_slots(cfg, n_ranks), cfg.expert_ffn
    return {
        "embed": _Leaf((cfg.vocab, h), "embed"),
        "dense": {"attn_norm": norm(ld, h), "attn": attn(ld), "ffn_norm": norm(ld, h),
                  "ffn": ffn(ld, cfg.dense_ffn)},
        "moe": {"attn_norm": norm(lm, h), "attn": attn(lm), "ffn_norm": norm(lm, h),
                "router": _Leaf((lm, h, cfg.n_experts), "router"),
                "shared": ffn(lm, cfg.shared_ffn),
                "experts": {"w_gate": mm(lm, es, h, fe, contract=2, expert=True),
                            "w_up": mm(lm, es, h, fe, contract=2, expert=True),
                            "w_down": mm(lm, es, fe, h, contract=2, expert=True)}},
        "final_norm": norm(h),
        "lm_head": mm(h, cfg.vocab, contract=0),
    }


def _is_leaf(x):
    return isinstance(x, _Leaf)


def _leaf_dtype(cfg, leaf):
    if leaf.kind == "router":
        return jnp.dtype(_F32)
    return cfg.float_param


def param_specs(cfg: Config, n_ranks: int):
    """Global shapes and dtypes of the parameters (routed experts: E_slots leading after the layer axis)."""
    def spec(leaf):
        if leaf.kind == "matmul" and cfg.quantized:
            s = leaf.shape[:leaf.contract] + leaf.shape[leaf.contract + 1:]
            return {"w": jax.ShapeDtypeStruct(leaf.shape, jnp.int8), "s": jax.ShapeDtypeStruct(s, _F32)}
        return jax.ShapeDtypeStruct(leaf.shape, _leaf_dtype(cfg, leaf))
    return jax.tree.map(spec, _layout(cfg, n_ranks), is_leaf=_is_leaf)


def param_pspecs(cfg: Config, axis: str = "ep"):
    """PartitionSpecs: the routed experts ``P(None, axis)`` (layer axis, then the expert-slot
    axis), every other leaf replicated ``P()``."""
    def pspec(leaf):
        p = P(None, axis) if leaf.expert else P()
        return {"w": p, "s": p} if (leaf.kind == "matmul" and cfg.quantized) else p
    return jax.tree.map(pspec, _layout(cfg, 1), is_leaf=_is_leaf)


def quantize_weight(w, contract: int):
    """Symmetric int8 with one float32 scale per output channel (max |w| over the contracted axis / 127)."""
    w = np.asarray(w, np.float32)
    s = np.maximum(np.max(np.abs(w), axis=contract) / 127.0, 1e-12).astype(np.float32)
    q = np.clip(np.round(w / np.expand_dims(s, contract)), -127, 127).astype(np.int8)
    return {"w": jnp.asarray(q), "s": jnp.asarray(s)}


def init_params(cfg: Config, key, n_ranks: int):
    """Random parameters (global arrays, for the tiny sizes: drawn on the host with numpy, seeded
    from ``key``, a JAX PRNG key or an int). Matmul weights are normal / sqrt(fan_in), norm
    weights 1 + 0.1 normal, the embedding normal. The float values depend only on the sizes and
    the key, not on the dtypes, so ``tiny(param_dtype="int8")`` gives the int8 quantization of
    the float model ``tiny()`` initialised with the same key."""
    if isinstance(key, (int, np.integer)):
        seed = [int(key)]
    else:
        key = jnp.asarray(key)
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        seed = [int(v) for v in np.asarray(data).reshape(-1)]
    leaves, treedef = jax.tree.flatten(_layout(cfg, n_ranks), is_leaf=_is_leaf)
    out = []
    for i, leaf in enumerate(leaves):
        z = np.random.default_rng(seed + [i]).standard_normal(leaf.shape, np.float32)
        if leaf.kind == "norm":
            out.append(jnp.asarray(1.0 + 0.1 * z, _leaf_dtype(cfg, leaf)))
        elif leaf.kind == "embed":
            out.append(jnp.asarray(z, _leaf_dtype(cfg, leaf)))
        else:
            w = z / np.float32(math.sqrt(leaf.shape[leaf.contract] if leaf.kind == "matmul" else leaf.shape[-2]))
            if leaf.kind == "matmul" and cfg.quantized:
                out.append(quantize_weight(w, leaf.contract))
            else:
                out.append(jnp.asarray(w, _leaf_dtype(cfg, leaf)))
    return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------------------------
# building blocks (plain jnp; the same code runs per rank and in the references)


def _mm(cfg, eq, x, w, out_dtype=None):
    """``einsum(eq, x, w)`` with a float or an int8 weight.

    int8 weight ``{"w": int8, "s": per-output-channel float32 scale or None}``: x is quantized
    per token (one scale per index of its non-contracted axes), the product is
    ``dot_general(int8, int8, preferred_element_type=int32)`` and is dequantized with both scales."""
    out_dtype = out_dtype or cfg.act
    if not isinstance(w, dict):
        return jnp.einsum(eq, x.astype(cfg.act), w.astype(cfg.act)).astype(out_dtype)
    ins, out = eq.split("->")
    xs, ws = ins.split(",")
    contracted = tuple(i for i, c in enumerate(xs) if c not in out)
    xf = x.astype(_F32)
    sx = jnp.maximum(jnp.max(jnp.abs(xf), axis=contracted, keepdims=True) / 127.0, 1e-12)
    xq = jnp.clip(jnp.round(xf / sx), -127, 127).astype(jnp.int8)
    y = jnp.einsum(eq, xq, w["w"], preferred_element_type=jnp.int32).astype(_F32)
    y = y * _to_out(jnp.squeeze(sx, contracted), "".join(c for c in xs if c in out), out)
    if w.get("s") is not None:
        y = y * _to_out(w["s"], "".join(c for c in ws if c in out), out)
    return y.astype(out_dtype)


def _to_out(s, sub, out):
    """Broadcasts ``s`` (axes named by ``sub``, each in ``out``) against an array named ``out``."""
    order = sorted(range(len(sub)), key=lambda i: out.index(sub[i]))
    s = jnp.transpose(s, order)
    kept = [sub[i] for i in order]
    return s.reshape([s.shape[kept.index(c)] if c in kept else 1 for c in out])


def _rms(cfg, x, w):
    xf = x.astype(_F32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_eps) * w.astype(_F32)
    return y.astype(x.dtype)


def _rope(cfg, x, pos):
    """Rotary embedding (rotate-half) on the last axis of ``x``; ``pos`` names x's leading axes."""
    d = x.shape[-1]
    inv = cfg.rope_theta ** (-jnp.arange(0, d, 2, dtype=_F32) / d)
    ang = pos.astype(_F32)[..., None] * inv
    ang = ang.reshape(ang.shape[:-1] + (1,) * (x.ndim - pos.ndim - 1) + ang.shape[-1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(_F32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _swiglu(cfg, p, x):
    """SwiGLU FFN on tokens ``x [T, H]``."""
    g = _mm(cfg, "th,hf->tf", x, p["w_gate"])
    u = _mm(cfg, "th,hf->tf", x, p["w_up"])
    a = (jax.nn.silu(g.astype(_F32)) * u.astype(_F32)).astype(cfg.act)
    return _mm(cfg, "tf,fh->th", a, p["w_down"])


def _experts(cfg, pe, recv):
    """Every local expert's SwiGLU FFN on its rows: ``[E_local, C, H] -> [E_local, C, H]``."""
    g = _mm(cfg, "ech,ehf->ecf", recv, pe["w_gate"])
    u = _mm(cfg, "ech,ehf->ecf", recv, pe["w_up"])
    a = (jax.nn.silu(g.astype(_F32)) * u.astype(_F32)).astype(cfg.act)
    return _mm(cfg, "ecf,efh->ech", a, pe["w_down"])


def _route(cfg, router, x):
    """Router on ``x [T, H]``: ``(weights [T, K] float32, expert ids [T, K] int32)``; scores are a
    sigmoid (DeepSeek-V3) or a softmax over the E routed experts, weights the top-k scores
    normalised over the k, times ``routed_scaling_factor``."""
    logits = jnp.einsum("th,he->te", x.astype(_F32), router.astype(_F32))
    scores = jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    top, idx = lax.top_k(scores, cfg.top_k)
    w = top / jnp.sum(top, axis=-1, keepdims=True) * cfg.routed_scaling_factor
    return w, idx.astype(jnp.int32)


# -- MLA attention ---------------------------------------------------------------------------------


def _mla_q(cfg, p, xn, pos):
    """Queries of tokens ``xn [T, H]`` at positions ``pos [T]``: ``q_nope [T, h, nope]``, ``q_pe [T, h, rope]``."""
    t = xn.shape[0]
    cq = _rms(cfg, _mm(cfg, "th,hq->tq", xn, p["wq_a"]), p["q_norm"])
    q = _mm(cfg, "tq,qo->to", cq, p["wq_b"]).reshape(t, cfg.n_heads, cfg.qk_head_dim)
    return q[..., : cfg.nope_head_dim], _rope(cfg, q[..., cfg.nope_head_dim:], pos)


def _mla_entry(cfg, p, xn, pos):
    """The latent cache entry of tokens ``xn [T, H]``: ``[T, kv_lora + rope]`` = [normalised KV
    latent, roped shared key]."""
    kv = _mm(cfg, "th,hc->tc", xn, p["wkv_a"])
    lat = _rms(cfg, kv[:, : cfg.kv_lora_rank], p["kv_norm"])
    return jnp.concatenate([lat, _rope(cfg, kv[:, cfg.kv_lora_rank:], pos)], axis=-1)


def _mla_standard(cfg, p, q_nope, q_pe, kv, mask):
    """Non-absorbed MLA: keys and values up-projected from the latents of ``kv [B, S, kv_lora+rope]``.
    ``q_nope/q_pe [B, T, h, .]``, ``mask [B, T, S]`` (True: attend). Returns ``[B * T, H]``."""
    b, s, _ = kv.shape
    t = q_nope.shape[1]
    lat, k_pe = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank:]
    k_nope = _mm(cfg, "sc,chd->shd", lat.reshape(b * s, -1), p["w_uk"]).reshape(b, s, cfg.n_heads, -1)
    v = _mm(cfg, "sc,chv->shv", lat.reshape(b * s, -1), p["w_uv"]).reshape(b, s, cfg.n_heads, -1)
    o = _attention_kernel(cfg, "mla_attention")(q_nope, q_pe, k_nope, k_pe, v, mask)
    return _mm(cfg, "tx,xh->th", o.reshape(b * t, cfg.n_heads * cfg.v_head_dim), p["wo"])


def _attention_kernel(cfg, name):
    """The attention core as one fused kernel for the step model (strata.emulator.fused: the
    scores and probabilities stay on chip, as in the fused MLA kernels deployments run); on the
    host an ordinary jax.jit, inlined into the step."""
    return strata.emulator.fused(functools.partial(_ATTENTION[name], cfg), name=name)


def _mla_attention(cfg, q_nope, q_pe, k_nope, k_pe, v, mask):
    """softmax(q k^T / sqrt(d), masked) v for ``q_nope/q_pe [B, T, h, .]``, ``k_nope/v [B, S, h, .]``,
    ``k_pe [B, S, rope]``, ``mask [B, T, S]``: ``[B, T, h, v]``."""
    scores = (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, preferred_element_type=_F32)
              + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, preferred_element_type=_F32))
    scores = jnp.where(mask[:, None], scores / math.sqrt(cfg.qk_head_dim), _NEG)
    prob = jax.nn.softmax(scores, axis=-1).astype(cfg.act)
    return jnp.einsum("bhts,bshv->bthv", prob, v)


def _mla_absorbed(cfg, p, q_nope, q_pe, cache, pos, entry):
    """Absorbed MLA decode of one token per sequence: q_nope goes through W_uk into the latent
    space, attention runs over the latent cache, the output leaves through W_uv.

    ``q_nope [B, h, nope]``, ``q_pe [B, h, rope]``, ``cache [B, context, kv_lora+rope]`` (the
    positions before ``pos [B]`` are valid), ``entry [B, kv_lora+rope]`` (this token's, at ``pos``).
    Returns ``[B, H]``."""
    w_uk = p["w_uk"]
    if isinstance(w_uk, dict):  # W_uk's per-channel scale sits on the absorbed (contracted) axis: fold it into q
        q_lat = _mm(cfg, "bhd,chd->bhc", q_nope.astype(_F32) * w_uk["s"], {"w": w_uk["w"], "s": None})
    else:
        q_lat = _mm(cfg, "bhd,chd->bhc", q_nope, w_uk)
    o_lat = _attention_kernel(cfg, "mla_decode_attention")(q_lat, q_pe, cache, pos, entry)
    o = _mm(cfg, "bhc,chv->bhv", o_lat, p["w_uv"])
    return _mm(cfg, "bx,xh->bh", o.reshape(o.shape[0], -1), p["wo"])


def _mla_decode_attention(cfg, q_lat, q_pe, cache, pos, entry):
    """Attention of one token per sequence over the latent cache (positions < ``pos`` valid) and
    its own ``entry``: ``q_lat [B, h, kv_lora]``, ``q_pe [B, h, rope]``, ``cache [B, context,
    kv_lora+rope]``, ``entry [B, kv_lora+rope]`` -> the latent output ``[B, h, kv_lora]``."""
    kvl, ctx = cfg.kv_lora_rank, cache.shape[1]
    lat, k_pe = cache[..., :kvl], cache[..., kvl:]
    s_cache = (jnp.einsum("bhc,bsc->bhs", q_lat, lat, preferred_element_type=_F32)
               + jnp.einsum("bhr,bsr->bhs", q_pe, k_pe, preferred_element_type=_F32))
    s_new = (jnp.einsum("bhc,bc->bh", q_lat, entry[:, :kvl], preferred_element_type=_F32)
             + jnp.einsum("bhr,br->bh", q_pe, entry[:, kvl:], preferred_element_type=_F32))
    valid = jnp.arange(ctx, dtype=pos.dtype)[None, :] < pos[:, None]  # [B, context]
    s_cache = jnp.where(valid[:, None, :], s_cache, _NEG)
    scores = jnp.concatenate([s_cache, s_new[..., None]], axis=-1) / math.sqrt(cfg.qk_head_dim)
    prob = jax.nn.softmax(scores, axis=-1)
    return (jnp.einsum("bhs,bsc->bhc", prob[..., :ctx].astype(cfg.act), lat, preferred_element_type=_F32)
            + prob[..., ctx:] * entry[:, None, :kvl].astype(_F32)).astype(cfg.act)


_ATTENTION = {"mla_attention": _mla_attention, "mla_decode_attention": _mla_decode_attention}


# -- routed experts: expert parallel (strata) or dense (reference) ---------------------------------


class _ExpertParallel:
    """Routed experts over the mesh axis: strata.moe.dispatch -> batched experts -> strata.moe.combine."""

    def __init__(self, cfg, axis, num_slots, capacity):
        self.cfg, self.axis, self.num_slots, self.capacity = cfg, axis, num_slots, capacity

    def dispatch(self, pe, x, w, idx):
        recv, handle = strata.moe.dispatch(x, idx, axis_name=self.axis, num_experts=self.num_slots,
                                           capacity=self.capacity)
        return recv, handle, w

    def experts(self, pe, state):
        recv, handle, w = state
        return _experts(self.cfg, pe, recv), handle, w

    def combine(self, state):
        ey, handle, w = state
        return strata.moe.combine(ey, handle, w)


class _DenseRouted:
    """Reference: every expert on every token, the top-k ones summed with their weights (no capacity)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def dispatch(self, pe, x, w, idx):
        return x, w, idx

    def experts(self, pe, state):
        x, w, idx = state
        e = self.cfg.n_experts
        real = jax.tree.map(lambda a: a[:e], pe)  # slots >= E are never routed
        y_all = _experts(self.cfg, real, jnp.broadcast_to(x[None], (e,) + x.shape))  # [E, T, H]
        comb = jnp.zeros((x.shape[0], e), _F32).at[jnp.arange(x.shape[0])[:, None], idx].add(w)
        return jnp.einsum("te,eth->th", comb, y_all.astype(_F32)).astype(self.cfg.act)

    def combine(self, state):
        return state


# -- layers ----------------------------------------------------------------------------------------


def _dense_ffn(cfg, p, x):
    """x + SwiGLU(RMSNorm(x)) for x [..., H]."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    return (xf + _swiglu(cfg, p["ffn"], _rms(cfg, xf, p["ffn_norm"]))).reshape(shape)


def _moe_layer(cfg, p, xs, attn_fn, routed):
    """One MoE layer on the microbatches ``xs`` (a list), interleaved in program order as
    CloudMatrix-Infer's two-microbatch pipeline does: attention of microbatch i+1 is issued after
    microbatch i's dispatch and before its combine, so the collective can overlap it::

        attn0, dispatch0, shared0, attn1, experts0, dispatch1, combine0, shared1, experts1, combine1

    ``attn_fn(i, x)`` returns (x + attention, extra output). Returns (new xs, extras)."""
    outs, extras, prev = [], [], None
    for i, x in enumerate(xs):
        x, extra = attn_fn(i, x)
        extras.append(extra)
        if prev is not None:
            prev = dict(prev, state=routed.experts(p["experts"], prev["state"]))
        xt = x.reshape(-1, x.shape[-1])
        xn = _rms(cfg, xt, p["ffn_norm"])
        w, idx = _route(cfg, p["router"], xn)
        cur = {"x": xt, "state": routed.dispatch(p["experts"], xn, w, idx)}
        if prev is not None:
            outs.append(prev["x"] + prev["shared"] + routed.combine(prev["state"]))
        cur["shared"] = _swiglu(cfg, p["shared"], xn)  # shared expert: local, data parallel
        prev = cur
    prev = dict(prev, state=routed.experts(p["experts"], prev["state"]))
    outs.append(prev["x"] + prev["shared"] + routed.combine(prev["state"]))
    return [o.reshape(x.shape) for o, x in zip(outs, xs)], extras


def _run_layers(cfg, params, xs, attn_fn, routed, remat=False):
    """All layers: one lax.scan over the dense layers, one over the MoE layers.

    ``attn_fn(layer, p_layer, i, x)`` -> (x + attention of microbatch i, extra); ``layer`` is
    the absolute layer index (a tracer). Returns (xs, extras stacked [n_layers, ...] per microbatch).
    ``remat``: each layer body is a ``jax.checkpoint`` (recomputed in the backward pass)."""
    extras_all = []

    def dense_body(carry, inp):
        p, layer = inp
        new, extras = [], []
        for i, x in enumerate(carry):
            x, extra = attn_fn(layer, p, i, x)
            new.append(_dense_ffn(cfg, p, x))
            extras.append(extra)
        return new, extras

    def moe_body(carry, inp):
        p, layer = inp
        return _moe_layer(cfg, p, list(carry), lambda i, x: attn_fn(layer, p, i, x), routed)

    if remat:
        dense_body, moe_body = jax.checkpoint(dense_body), jax.checkpoint(moe_body)
    if cfg.n_dense_layers:
        xs, ext = lax.scan(dense_body, list(xs), (params["dense"], jnp.arange(cfg.n_dense_layers)))
        extras_all.append(ext)
    if cfg.n_moe_layers:
        xs, ext = lax.scan(moe_body, list(xs),
                           (params["moe"], cfg.n_dense_layers + jnp.arange(cfg.n_moe_layers)))
        extras_all.append(ext)
    extras = [jnp.concatenate([e[i] for e in extras_all], axis=0) for i in range(len(xs))]
    return xs, extras


def _embed(cfg, params, tokens):
    return jnp.take(params["embed"], tokens, axis=0).astype(cfg.act)


def _logits(cfg, params, x):
    """float32 logits of tokens ``x [T, H]``."""
    return _mm(cfg, "th,hv->tv", _rms(cfg, x, params["final_norm"]), params["lm_head"], out_dtype=_F32)


# -- the three forward passes (per rank, or on one device for the references) ----------------------


def _decode_forward(cfg, params, tokens, positions, kv_cache, routed, microbatches, absorbed):
    """One decode step of ``tokens [B]`` at ``positions [B]`` with the latent cache
    ``kv_cache [n_layers, B, context, kv_lora+rope]`` (positions < pos valid). Returns
    (logits [B, V] float32, cache with this step's entries written at ``positions``)."""
    b = tokens.shape[0]
    if b % microbatches:
        raise ValueError(f"the local batch {b} does not split into {microbatches} microbatches")
    bm = b // microbatches
    x = _embed(cfg, params, tokens)
    xs = [x[i * bm:(i + 1) * bm] for i in range(microbatches)]
    pos_mb = [positions[i * bm:(i + 1) * bm] for i in range(microbatches)]

    def attn_fn(layer, p, i, x):
        pos = pos_mb[i]
        # One slice of the layer's and micro-batch's cache (read once, not the layer's whole cache).
        cache = lax.dynamic_slice(kv_cache, (layer, i * bm, 0, 0), (1, bm) + kv_cache.shape[2:])[0]
        xn = _rms(cfg, x, p["attn_norm"])
        q_nope, q_pe = _mla_q(cfg, p["attn"], xn, pos)
        entry = _mla_entry(cfg, p["attn"], xn, pos)
        if absorbed:
            o = _mla_absorbed(cfg, p["attn"], q_nope, q_pe, cache, pos, entry)
        else:  # reference: write the entry, up-project the whole cache, mask by position
            full = cache.at[jnp.arange(bm), pos].set(entry.astype(cache.dtype))
            mask = (jnp.arange(full.shape[1])[None, :] <= pos[:, None])[:, None, :]
            o = _mla_standard(cfg, p["attn"], q_nope[:, None], q_pe[:, None], full, mask)
        return x + o, entry.astype(kv_cache.dtype)

    xs, entries = _run_layers(cfg, params, xs, attn_fn, routed)
    logits = _logits(cfg, params, jnp.concatenate(xs, axis=0))
    entries = jnp.concatenate(entries, axis=1)  # [n_layers, B, kv_lora+rope]
    new_cache = kv_cache.at[:, jnp.arange(b), positions].set(entries)
    return logits, new_cache


def _sequence_forward(cfg, params, tokens, routed, remat=False):
    """Causal forward of ``tokens [B, L]`` (standard MLA): (hidden [B, L, H], cache [n_layers, B, L, kv_lora+rope])."""
    b, l = tokens.shape
    x = _embed(cfg, params, tokens)
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)).reshape(-1)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((l, l), bool)), (b, l, l))

    def attn_fn(layer, p, i, x):
        xn = _rms(cfg, x.reshape(b * l, -1), p["attn_norm"])
        q_nope, q_pe = _mla_q(cfg, p["attn"], xn, pos)
        entry = _mla_entry(cfg, p["attn"], xn, pos).reshape(b, l, -1)
        o = _mla_standard(cfg, p["attn"], q_nope.reshape(b, l, cfg.n_heads, -1),
                          q_pe.reshape(b, l, cfg.n_heads, -1), entry, mask)
        return x + o.reshape(x.shape), entry

    (x,), (cache,) = _run_layers(cfg, params, [x], attn_fn, routed, remat)
    return x, cache


def _prefill_forward(cfg, params, tokens, routed):
    x, cache = _sequence_forward(cfg, params, tokens, routed)
    return _logits(cfg, params, x[:, -1]), cache


def _train_loss(cfg, params, tokens, targets, routed, remat=False):
    x, _ = _sequence_forward(cfg, params, tokens, routed, remat)
    logits = _logits(cfg, params, x.reshape(-1, x.shape[-1]))
    tgt = targets.reshape(-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tgt[:, None], axis=-1)[:, 0]
    return jnp.mean(nll)


# ------------------------------------------------------------------------------------------------
# the steps: jax.shard_map over one expert axis; what a user jits


def _n_ranks(mesh, axis):
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]


def decode_step(cfg: Config, mesh, *, batch_per_rank: int, context: int, capacity: int | None = None,
                microbatches: int = 1, axis: str = "ep"):
    """One decode step (absorbed MLA over the latent cache, expert-parallel MoE).

    Returns ``(fn, args_specs)``; ``fn(params, tokens [N*B] int32, positions [N*B] int32,
    kv_cache [n_layers, N*B, context, kv_lora+rope] act dtype) -> (logits [N*B, vocab] float32,
    new kv_cache)``. Cache positions < ``positions`` are valid; the step writes its entries at
    ``positions`` (each < context). ``microbatches=2`` splits the local batch in two and
    interleaves them in each MoE layer (attention of one overlaps the other's dispatch/combine);
    the results equal ``microbatches=1``."""
    n = _n_ranks(mesh, axis)
    if batch_per_rank % microbatches:
        raise ValueError(f"batch_per_rank={batch_per_rank} is not divisible by microbatches={microbatches}")
    cap = capacity or default_capacity(cfg, n, batch_per_rank // microbatches)
    routed = _ExpertParallel(cfg, axis, expert_slots(cfg, n), cap)

    def body(params, tokens, positions, kv_cache):
        return _decode_forward(cfg, params, tokens, positions, kv_cache, routed, microbatches, absorbed=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(param_pspecs(cfg, axis), P(axis), P(axis), P(None, axis)),
                       out_specs=(P(axis), P(None, axis)), check_vma=False)
    nb = n * batch_per_rank
    specs = (param_specs(cfg, n), jax.ShapeDtypeStruct((nb,), jnp.int32), jax.ShapeDtypeStruct((nb,), jnp.int32),
             jax.ShapeDtypeStruct((cfg.n_layers, nb, context, cfg.cache_dim), cfg.act))
    return fn, specs


def prefill_step(cfg: Config, mesh, *, batch_per_rank: int, prompt_len: int, capacity: int | None = None,
                 axis: str = "ep"):
    """Prefill of ``prompt_len`` tokens per sequence (standard MLA, causal).

    Returns ``(fn, args_specs)``; ``fn(params, tokens [N*B, L] int32) -> (logits of the last
    position [N*B, vocab] float32, kv_cache [n_layers, N*B, L, kv_lora+rope])``."""
    n = _n_ranks(mesh, axis)
    cap = capacity or default_capacity(cfg, n, batch_per_rank * prompt_len)
    routed = _ExpertParallel(cfg, axis, expert_slots(cfg, n), cap)

    def body(params, tokens):
        return _prefill_forward(cfg, params, tokens, routed)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(param_pspecs(cfg, axis), P(axis)),
                       out_specs=(P(axis), P(None, axis)), check_vma=False)
    specs = (param_specs(cfg, n), jax.ShapeDtypeStruct((n * batch_per_rank, prompt_len), jnp.int32))
    return fn, specs


def _split_experts(tree):
    moe = dict(tree["moe"])
    experts = moe.pop("experts")
    return dict(tree, moe=moe), experts


def train_step(cfg: Config, mesh, *, batch_per_rank: int, seq_len: int, capacity: int | None = None,
               axis: str = "ep", remat: bool = False):
    """Forward and backward of next-token cross entropy.

    Returns ``(fn, args_specs)``; ``fn(params, tokens [N*B, S] int32, targets [N*B, S] int32) ->
    (loss, grads)``: loss is the mean over all ranks' tokens (strata.all_reduce mean of the local
    means), grads a pytree like params. Gradients of the replicated parameters are averaged over
    the axis with ``strata.all_reduce(op="mean")``; a rank's expert gradients already hold every
    rank's tokens (combine's and dispatch's transposes bring them back), so they stay local and
    are only divided by N. ``remat=True`` checkpoints each layer (recomputed in the backward)."""
    if cfg.quantized:
        raise ValueError("train_step needs float parameters (param_dtype bfloat16 or float32), not int8")
    n = _n_ranks(mesh, axis)
    cap = capacity or default_capacity(cfg, n, batch_per_rank * seq_len)
    routed = _ExpertParallel(cfg, axis, expert_slots(cfg, n), cap)
    pspecs = param_pspecs(cfg, axis)

    def body(params, tokens, targets):
        loss, grads = jax.value_and_grad(
            lambda prm: _train_loss(cfg, prm, tokens, targets, routed, remat))(params)
        replicated, g_experts = _split_experts(grads)
        replicated = strata.all_reduce(replicated, axis, op="mean")
        g_experts = jax.tree.map(lambda g: g / n, g_experts)
        replicated["moe"] = dict(replicated["moe"], experts=g_experts)
        return strata.all_reduce(loss, axis, op="mean"), replicated

    fn = jax.shard_map(body, mesh=mesh, in_specs=(pspecs, P(axis), P(axis)), out_specs=(P(), pspecs),
                       check_vma=False)
    tok = jax.ShapeDtypeStruct((n * batch_per_rank, seq_len), jnp.int32)
    return fn, (param_specs(cfg, n), tok, tok)


# ------------------------------------------------------------------------------------------------
# single-device references (plain jnp, no capacity: every routed pair kept)


def reference_decode(cfg: Config, params, tokens, positions, kv_cache):
    """``decode_step`` on one device with the standard (non-absorbed) MLA: (logits, new kv_cache)."""
    return _decode_forward(cfg, params, tokens, positions, kv_cache, _DenseRouted(cfg), 1, absorbed=False)


def reference_prefill(cfg: Config, params, tokens):
    """``prefill_step`` on one device: (logits of the last position, kv_cache)."""
    return _prefill_forward(cfg, params, tokens, _DenseRouted(cfg))


def reference_train_loss(cfg: Config, params, tokens, targets):
    """Mean next-token cross entropy over every token, on one device (grads: ``jax.grad`` of it)."""
    return _train_loss(cfg, params, tokens, targets, _DenseRouted(cfg))
