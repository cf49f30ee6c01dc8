"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2 via bias flags) as a flax nnx module.

Per-layer weights are stacked along a leading ``num_layers`` axis and the layers run as
one ``lax.scan``, so compile time does not grow with depth. Projections are stored as
``[in_features, out_features]``. The KV cache ``(k, v)``, each
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``, travels in the scan
carry and is returned updated. Inside the scan it is viewed as one flat page pool
``[num_layers * num_blocks, ...]`` (a free reshape), and layer ``l`` addresses its pages
by offsetting block ids by ``l * num_blocks``: no layer's cache is ever sliced out and
written back, which on the CPU copied the whole cache several times per step.

With a ``mesh`` (tensor parallelism, ``jaxpage.parallel``) the weights arrive sharded and
XLA partitions the projections; the KV cache update and the paged attention run under
``shard_map`` over the KV-head axis, each device on its own heads with the unchanged
attention function (the shapes it sees are the per-device ones).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxpage.models.arch_config import ArchConfig
from jaxpage.parallel.sharding_rules import TP
from pallas_kernels.kv_cache_update import kv_cache_update
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

KVCache = tuple[jax.Array, jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout). x: [T, H, D], positions: int32 [T]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, None, :]  # [T, 1, D]
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, each stacked as [num_layers, ...]."""

    def __init__(self, cfg: ArchConfig, *, dtype: Any, rngs: nnx.Rngs) -> None:
        L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        init = nnx.initializers.normal(0.02)

        def weight(*shape: int) -> nnx.Param:
            return nnx.Param(init(rngs.params(), (L, *shape), dtype))

        self.input_norm = nnx.Param(jnp.ones((L, H), dtype))
        self.post_attention_norm = nnx.Param(jnp.ones((L, H), dtype))
        self.q_proj, self.k_proj, self.v_proj = weight(H, q_dim), weight(H, kv_dim), weight(H, kv_dim)
        self.o_proj = weight(q_dim, H)
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((L, q_dim), dtype))
            self.k_bias = nnx.Param(jnp.zeros((L, kv_dim), dtype))
            self.v_bias = nnx.Param(jnp.zeros((L, kv_dim), dtype))
        if cfg.o_bias:
            self.o_bias = nnx.Param(jnp.zeros((L, H), dtype))
        self.gate_proj, self.up_proj, self.down_proj = weight(H, I), weight(H, I), weight(I, H)

    def stacked(self) -> dict[str, jax.Array]:
        return {name: value[...] for name, value in vars(self).items()
                if isinstance(value, nnx.Param)}


class CausalLM(nnx.Module):
    """Embeddings -> scanned decoder layers -> final norm; ``compute_logits`` for the head."""

    def __init__(self, cfg: ArchConfig, *, dtype: Any = jnp.float32,
                 attention_backend: str = "auto", rngs: nnx.Rngs,
                 mesh: jax.sharding.Mesh | None = None) -> None:
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.mesh = mesh  # static: a one-axis ("tp") mesh, or None on one device
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(
            rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = DecoderLayers(cfg, dtype=dtype, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(
                rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 batch: dict[str, jax.Array]) -> tuple[jax.Array, KVCache]:
        """input_ids, positions: int32 [T] -> hidden [T, hidden_size], updated kv_cache."""
        cfg = self.cfg
        inv_freq = jnp.asarray(cfg.rope_inv_freq())
        num_tokens = input_ids.shape[0]
        attention = self._sharded(self._attention)

        k_all, v_all = kv_cache                       # [L, N, B, Hkv, D] each
        num_layers, num_blocks, block_size = k_all.shape[:3]
        k_pool = k_all.reshape(num_layers * num_blocks, *k_all.shape[2:])  # [L*N, B, Hkv, D]
        v_pool = v_all.reshape(num_layers * num_blocks, *v_all.shape[2:])
        slot_mapping = batch["slot_mapping"]           # int32 [T], -1 = skip

        def layer(carry, xs):
            h, k_pool, v_pool = carry
            w, index = xs
            first_block = index * num_blocks           # this layer's block 0 in the pool
            x = rms_norm(h, w["input_norm"], cfg.rms_norm_eps)
            q = jnp.einsum("th,hd->td", x, w["q_proj"])
            k = jnp.einsum("th,hd->td", x, w["k_proj"])
            v = jnp.einsum("th,hd->td", x, w["v_proj"])
            if cfg.qkv_bias:
                q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
            q = apply_rope(q.reshape(num_tokens, cfg.num_heads, cfg.head_dim), positions, inv_freq)
            k = apply_rope(k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            slots = jnp.where(slot_mapping < 0, -1, slot_mapping + first_block * block_size)
            attn, k_pool, v_pool = attention(
                q, k, v, k_pool, v_pool, slots, batch["kv_lens"],
                batch["block_tables"] + first_block, batch["cu_q_lens"], batch["num_seqs"])
            out = jnp.einsum("td,dh->th", attn.reshape(num_tokens, -1), w["o_proj"])
            if cfg.o_bias:
                out = out + w["o_bias"]
            h = h + out
            x = rms_norm(h, w["post_attention_norm"], cfg.rms_norm_eps)
            gate = jnp.einsum("th,hi->ti", x, w["gate_proj"])
            up = jnp.einsum("th,hi->ti", x, w["up_proj"])
            h = h + jnp.einsum("ti,ih->th", jax.nn.silu(gate) * up, w["down_proj"])
            return (h, k_pool, v_pool), None

        h = self.embed[...][input_ids]                                     # [T, hidden]
        xs = (self.layers.stacked(), jnp.arange(cfg.num_layers, dtype=jnp.int32))
        (h, k_pool, v_pool), _ = jax.lax.scan(layer, (h, k_pool, v_pool), xs)
        return (rms_norm(h, self.final_norm[...], cfg.rms_norm_eps),
                (k_pool.reshape(k_all.shape), v_pool.reshape(v_all.shape)))

    def _attention(self, q, k, v, k_layer, v_layer, slot_mapping, kv_lens, block_tables,
                   cu_q_lens, num_seqs):
        """Write the new K/V into the pages, then attend: -> (attn, k_layer, v_layer).

        q: [T, Hq, D]; k, v: [T, Hkv, D]; k_layer, v_layer: the flat page pool
        [num_layers * num_blocks, block_size, Hkv, D] (per-device head counts under
        ``shard_map``), addressed through ``slot_mapping`` and ``block_tables`` already
        offset to the layer's pages.
        """
        k_layer, v_layer = kv_cache_update(k_layer, v_layer, k, v, slot_mapping)
        attn = ragged_paged_attention(
            q, k_layer, v_layer, kv_lens, block_tables, cu_q_lens, num_seqs,
            sm_scale=self.cfg.head_dim ** -0.5, sliding_window=self.cfg.sliding_window,
            backend=self.attention_backend)
        return attn, k_layer, v_layer

    def _sharded(self, attention):
        """``attention`` under ``shard_map`` over the KV-head axis when there is a mesh."""
        if self.mesh is None:
            return attention
        heads, pages, whole = P(None, TP, None), P(None, None, TP, None), P()
        return jax.shard_map(
            attention, mesh=self.mesh,
            in_specs=(heads, heads, heads, pages, pages, whole, whole, whole, whole, whole),
            out_specs=(heads, pages, pages), check_vma=False)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("nh,vh->nv", hidden, self.embed[...])
        else:
            logits = jnp.einsum("nh,hv->nv", hidden, self.lm_head[...])
        return logits.astype(jnp.float32)
