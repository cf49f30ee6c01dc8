"""The decoder-only transformer of the Llama family as a flax nnx module.

One module serves every dense family the registry names (``jaxpage.models.registry``):
Llama 2/3, SmolLM2, Mistral, Qwen2/3, Phi-3, Gemma 2/3. They differ only in facts of
``ArchConfig``: biases, per-head q/k norms, Gemma's (1 + w) norms and the extra norms on
the attention and MLP outputs, the MLP activation, the embedding scale, the softmax
scale, soft caps on scores and logits, partial RoPE, and which layers attend within a
sliding window (each with its own RoPE base).

Each layer owns its weights (``layers[l]``, projections stored ``[in_features,
out_features]``) and the forward pass is a Python loop over the layers, unrolled in the
traced program. The layers are deliberately not stacked into ``[num_layers, ...]`` arrays
run by ``lax.scan``: XLA copies each layer's slice out of a stacked array before the
matmuls read it, which on the CPU cost more than the matmuls themselves at decode batch
sizes (``docs/benchmarks/layer_loop.md``). The price is a program that grows with depth,
so compiling takes longer.

The KV cache ``(k, v)``, each ``[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``, goes whole into every layer's ``write_and_attend`` (``pallas_kernels``), which
writes and reads only that layer's pages and returns the whole cache updated: no layer's
cache is ever sliced out and written back, which on the CPU copied the whole cache
several times per step.

With a ``mesh`` (tensor parallelism, ``jaxpage.parallel``) the weights arrive sharded and
XLA partitions the projections; the KV cache update and the paged attention run under
``shard_map`` over the KV-head axis, each device on its own heads with the unchanged
attention function (the shapes it sees are the per-device ones).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxpage.arch_config import ArchConfig
from jaxpage.models.layers import ACTIVATIONS, RopeTable, project, rms_norm, rope_table, rotate
from jaxpage.models.lora import LoRATokens, lora_delta, token_slots
from jaxpage.models.moe import moe_mlp
from jaxpage.models.params import ParamInit, QuantizedWeight, linear
from jaxpage.models.quantize import QuantFormat
from jaxpage.parallel.sharding_rules import TP
from pallas_kernels import kv_layout
from pallas_kernels.kv_layout import KVCache  # (k, v) split or (kv,) fused
from pallas_kernels._backend import branches_wait_for_device
from pallas_kernels.kv_quant import encode, rotation
from pallas_kernels.kv_token_scale import encode_embedded, encode_per_token, per_token
from pallas_kernels.precision import dot_precision
from pallas_kernels.quantized_matmul import gather_columns
from pallas_kernels.write_and_attend import write_and_attend



class DecoderLayer(nnx.Module):
    """One decoder layer's weights (projections ``[in_features, out_features]``) and its
    forward pass."""

    def __init__(self, cfg: ArchConfig, *, dtype: Any, rngs: nnx.Rngs | None,
                 quant_plan: dict[str, QuantFormat] | None = None,
                 matmul_backend: str = "auto", sparse: bool = False,
                 mesh: jax.sharding.Mesh | None = None) -> None:
        H, I = cfg.hidden_size, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        init = ParamInit(rngs, dtype, quant_plan)
        weight = init.weight
        self.matmul_backend = matmul_backend  # static: the quantized matmuls' backend

        # Gemma's norms scale by (1 + weight): a new one starts at zeros
        norm = init.zeros if cfg.norm_offset else init.ones
        self.input_norm = norm(H)
        self.post_attention_norm = norm(H)  # before the MLP (Gemma: pre_feedforward_layernorm)
        if cfg.sandwich_norms:  # on the attention and MLP outputs, before each residual add
            self.attn_out_norm, self.mlp_out_norm = norm(H), norm(H)
        if cfg.qk_norm:  # over head_dim, shared by the heads
            self.q_norm, self.k_norm = norm(cfg.head_dim), norm(cfg.head_dim)
        self.q_proj, self.k_proj = weight("q_proj", H, q_dim), weight("k_proj", H, kv_dim)
        self.v_proj = weight("v_proj", H, kv_dim)
        self.o_proj = weight("o_proj", q_dim, H)
        if cfg.qkv_bias:
            self.q_bias = init.zeros(q_dim)
            self.k_bias = init.zeros(kv_dim)
            self.v_bias = init.zeros(kv_dim)
        if cfg.o_bias:
            self.o_bias = init.zeros(H)
        self.sparse = sparse  # static: the MLP is a mixture of experts (jaxpage.models.moe)
        self.mesh = mesh      # static: experts are split over its axis
        if not sparse:
            self.gate_proj, self.up_proj = weight("gate_proj", H, I), weight("up_proj", H, I)
            self.down_proj = weight("down_proj", I, H)
            return
        E, M = cfg.num_experts, cfg.moe_intermediate_size
        self.router = init.normal(H, E)
        self.expert_gate, self.expert_up = init.normal(E, H, M), init.normal(E, H, M)
        self.expert_down = init.normal(E, M, H)
        S = cfg.shared_expert_intermediate_size
        if S:
            self.shared_gate_proj, self.shared_up_proj = weight("shared_gate_proj", H, S), \
                weight("shared_up_proj", H, S)
            self.shared_down_proj = weight("shared_down_proj", S, H)
            self.shared_expert_gate = init.normal(H, 1)

    def _linear(self, name: str, x: jax.Array, lora: LoRATokens | None,
                rows: jax.Array | None = None) -> jax.Array:
        """Projection ``name`` of x [T, in], plus its LoRA slots' delta when the model
        has them (``jaxpage.models.lora``; ``lora`` says each token's slot). ``rows``: the
        tokens past it are padding (``linear``)."""
        out = linear(x, getattr(self, name), self.matmul_backend, rows)
        if lora is not None and hasattr(self, f"{name}_lora_a"):
            out = out + lora_delta(x, getattr(self, f"{name}_lora_a")[...],
                                   getattr(self, f"{name}_lora_b")[...], lora)
        return out

    def qkv(self, cfg: ArchConfig, h: jax.Array, rope: RopeTable,
            lora: LoRATokens | None = None, rows: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """h [T, hidden] -> rotated q [T, Hq, D], rotated k and v [T, Hkv, D]; ``rope``:
        the tokens' ``rope_table``. ``rows``: the tokens past it are padding (``linear``)."""
        num_tokens = h.shape[0]
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        x = rms_norm(h, self.input_norm[...], eps, offset)
        q = self._linear("q_proj", x, lora, rows)
        k = self._linear("k_proj", x, lora, rows)
        v = self._linear("v_proj", x, lora, rows)
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], eps, offset)
            k = rms_norm(k, self.k_norm[...], eps, offset)
        q, k = rotate(q, rope), rotate(k, rope)
        return q, k, v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)

    def finish(self, cfg: ArchConfig, h: jax.Array, attn: jax.Array,
               lora: LoRATokens | None = None, rows: jax.Array | None = None) -> jax.Array:
        """The residual stream after attention (attn [T, Hq, D]) and the MLP: [T, hidden].
        ``rows``: the tokens past it are padding (``linear``)."""
        out = self._linear("o_proj", attn.reshape(h.shape[0], -1), lora, rows)
        if cfg.o_bias:
            out = out + self.o_bias[...]
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        if cfg.sandwich_norms:
            out = rms_norm(out, self.attn_out_norm[...], eps, offset)
        h = h + out
        x = rms_norm(h, self.post_attention_norm[...], eps, offset)
        act = ACTIVATIONS[cfg.hidden_act]
        if self.sparse:
            out = self._experts(cfg, x, act)
        else:
            gate = self._linear("gate_proj", x, lora, rows)
            up = self._linear("up_proj", x, lora, rows)
            out = self._linear("down_proj", act(gate) * up, lora, rows)
        if cfg.sandwich_norms:
            out = rms_norm(out, self.mlp_out_norm[...], eps, offset)
        return h + out


    def _experts(self, cfg: ArchConfig, x: jax.Array, act) -> jax.Array:
        """The mixture-of-experts MLP of x [T, hidden] (plus the gated shared expert)."""
        out = moe_mlp(x, self.router[...], self.expert_gate[...], self.expert_up[...],
                      self.expert_down[...], k=cfg.num_experts_per_tok,
                      normalize=cfg.norm_topk_prob, act=act, mesh=self.mesh)
        if cfg.shared_expert_intermediate_size:
            mm = self.matmul_backend
            shared = linear(act(linear(x, self.shared_gate_proj, mm))
                            * linear(x, self.shared_up_proj, mm), self.shared_down_proj, mm)
            out = out + jax.nn.sigmoid(project("th,ho->to", x, self.shared_expert_gate[...])) \
                * shared
        return out


def _dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                            cfg: ArchConfig, layer: int) -> jax.Array:
    """One sequence's causal attention without a cache (q [T, Hq, D], k, v [T, Hkv, D])."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    kk, vv = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)      # [T, Hq, D]
    scores = jnp.einsum("qhd,khd->hqk", q, kk, precision=dot_precision(q.dtype))
    scores = scores.astype(jnp.float32) * cfg.softmax_scale
    if cfg.attn_softcap is not None:
        scores = jnp.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    window = cfg.window(layer)
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), vv, precision=dot_precision(v.dtype))


# ``CausalLM._rope_tables``: cos/sin evaluations above which the table is computed once.
_ROPE_ONCE_ELEMENTS = 1 << 18


def _rotated(x: jax.Array, back: bool = False, dtype: Any = None) -> jax.Array:
    """x [T, H, D] times ``kv_quant.rotation(D)`` (its transpose for ``back``), computed in
    float32, returned in ``dtype`` (default x's)."""
    r = jnp.asarray(rotation(x.shape[-1]))
    return jnp.einsum("thd,de->the", x.astype(jnp.float32), r.T if back else r,
                      precision=jax.lax.Precision.HIGHEST).astype(dtype or x.dtype)


class CausalLM(nnx.Module):
    """Embeddings -> decoder layers -> final norm; ``compute_logits`` for the head.

    ``rngs=None`` builds the parameters' shapes only (``ParamInit``), to load weights into.
    """

    def __init__(self, cfg: ArchConfig, *, dtype: Any = jnp.float32,
                 attention_backend: str = "auto", rngs: nnx.Rngs | None,
                 mesh: jax.sharding.Mesh | None = None,
                 quant_plan: dict[str, QuantFormat] | None = None,
                 kv_format: str | None = None) -> None:
        self.cfg = cfg
        # static: the KV cache's byte format (pallas_kernels.kv_quant), None for floats
        self.kv_format = kv_format
        self.attention_backend = attention_backend
        self.mesh = mesh  # static: a one-axis ("tp") mesh, or None on one device
        # the matmul kernels (C++ on CPUs, Pallas on TPUs and GPUs) cannot be split by XLA
        # over a mesh: the jnp form there. A one-device mesh splits nothing (a data-parallel
        # replica, and ``jaxpage plan``, which always builds a mesh): the kernels run
        self.matmul_backend = "auto" if mesh is None or mesh.size == 1 else "reference"
        init = ParamInit(rngs, dtype, quant_plan)
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        if "embed" in init.quant_plan:  # stored [hidden, vocab] (jaxpage.models.quantize)
            self.embed = init.weight("embed", hidden, vocab)
        else:
            self.embed = init.normal(vocab, hidden)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, quant_plan=quant_plan,
                                             matmul_backend=self.matmul_backend,
                                             sparse=cfg.is_sparse(i), mesh=mesh)
                                for i in range(cfg.num_layers)])
        self.final_norm = (init.zeros if cfg.norm_offset else init.ones)(hidden)
        if not cfg.tie_word_embeddings:
            self.lm_head = init.weight("lm_head", hidden, vocab)
        if kv_format is not None:
            # per layer, KV head and channel: the cache holds k / kv_scale[0], v / kv_scale[1]
            shape = (2, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            self.kv_scale = nnx.Param(jax.ShapeDtypeStruct(shape, jnp.float32) if rngs is None
                                      else jnp.ones(shape, jnp.float32))

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 batch: Any) -> tuple[jax.Array, KVCache]:
        """input_ids, positions: int32 [T] -> hidden [T, hidden_size], updated kv_cache.

        ``batch``: the runtime's ``StepBatch`` or ``ForwardBatch`` (``runtime.step_batch``;
        read by attribute): ``slot_mapping``, ``kv_lens``, ``block_tables``, ``cu_q_lens``,
        ``num_seqs``, ``lora_slot`` (with LoRA slots) and ``live_tokens`` (None, or an int32
        scalar: the tokens from it on are padding or finished rows; projections may skip
        them, their hidden states unspecified).
        """
        cfg = self.cfg
        rows = batch.live_tokens
        attention = self._sharded(self._attention)

        k_cache, v_cache = kv_layout.as_pair(kv_cache)  # split [L, N, B, Hkv, D] each,
        # or fused [L, N, B, W] and None (pallas_kernels.kv_layout)
        token = kv_layout.token_scales(kv_cache)  # () or an int8 cache's per-token scale
        # codes, uint8 [L, N, B, Hkv] for keys and for values (pallas_kernels.kv_token_scale)
        h = self.embed_tokens(input_ids)                                   # [T, hidden]
        lora = None
        if getattr(self, "lora_shape", None) is not None:  # each token's adapter slot
            lora = token_slots(self.lora_shape, batch.lora_slot, batch.cu_q_lens,
                               input_ids.shape[0], h.dtype)
        tables = self._rope_tables(positions)
        for index, layer in enumerate(self.layers):
            q, k, v = layer.qkv(cfg, h, tables[self._local(index)], lora, rows)
            scales, new_token = (), ()
            if self.kv_format is not None:
                q = _rotated(q)                                   # kv_quant.rotation
                if token:  # a scale per token and KV head, stored with it: [T, Hkv] codes
                    k, k_codes = encode_per_token(_rotated(k, dtype=jnp.float32))
                    v, v_codes = encode_per_token(_rotated(v, dtype=jnp.float32))
                    new_token = (k_codes, v_codes)
                elif v_cache is None and per_token(self.kv_format):  # fused int8: the
                    # codes ride in the value bytes (kv_token_scale.encode_embedded)
                    k, v = encode_embedded(_rotated(k, dtype=jnp.float32),
                                           _rotated(v, dtype=jnp.float32))
                else:  # this layer's [Hkv, D] key and value scales
                    scales = (self.kv_scale[...][0, index], self.kv_scale[...][1, index])
                    k = encode(_rotated(k, dtype=jnp.float32) / scales[0], self.kv_format)
                    v = encode(_rotated(v, dtype=jnp.float32) / scales[1], self.kv_format)
            attn, k_cache, v_cache, token = attention(
                q, k, v, k_cache, v_cache, batch.slot_mapping, batch.kv_lens,
                batch.block_tables, batch.cu_q_lens, batch.num_seqs, scales, new_token,
                token, layer=index)
            if self.kv_format is not None:
                attn = _rotated(attn, back=True)
            h = layer.finish(cfg, h, attn, lora, rows)
        return (rms_norm(h, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_offset),
                kv_layout.from_pair(k_cache, v_cache, token))

    def _local(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding one (whose RoPE may have its own base)."""
        return self.cfg.window(layer) is not None

    def _rope_tables(self, positions: jax.Array) -> dict[bool, RopeTable]:
        """``rope_table`` of the positions for the global layers (False) and, when there
        are any, the sliding ones (True). Computed once per forward pass when recomputing
        them in every rotation would take over ~262k cosines and sines (SmolLM2: from 12
        tokens; the tiny preset's batches, up to 1024 decodes, stay below). Never on a
        GPU: what keeps them apart is a conditional, and there a conditional makes the
        host wait for the device (``branches_wait_for_device``)."""
        cfg = self.cfg
        rotations = len(self.layers) * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
        once = (rotations * positions.shape[0] >= _ROPE_ONCE_ELEMENTS
                and not branches_wait_for_device())
        kinds = {self._local(index) for index in range(len(self.layers))}
        return {local: rope_table(positions, jnp.asarray(cfg.rope_inv_freq(local=local)), once)
                for local in kinds}

    def kv_amax(self, input_ids: jax.Array) -> jax.Array:
        """The largest |k| and |v|, rotated as a byte cache stores them
        (``kv_quant.rotation``), of one sequence's forward pass (input_ids int32 [T]),
        per layer, KV head and channel: float32 [2, L, Hkv, D]. Dense causal attention,
        no cache: what a quantized KV cache calibrates its scales from."""
        cfg = self.cfg
        positions = jnp.arange(input_ids.shape[0], dtype=jnp.int32)
        h = self.embed_tokens(input_ids)
        amax = []
        tables = self._rope_tables(positions)
        for index, layer in enumerate(self.layers):
            q, k, v = layer.qkv(cfg, h, tables[self._local(index)])
            amax.append(jnp.stack([jnp.abs(_rotated(k)).max(axis=0),
                                   jnp.abs(_rotated(v)).max(axis=0)]))
            h = layer.finish(cfg, h, _dense_causal_attention(q, k, v, cfg, index))
        return jnp.stack(amax, axis=1).astype(jnp.float32)

    def _attention(self, q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables,
                   cu_q_lens, num_seqs, scales=(), new_token=(), token=(), *, layer: int):
        """Write layer ``layer``'s new K/V into its pages, then attend:
        -> (attn [T, Hq, D], k_cache, v_cache, token).

        q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: every layer's pages
        [L, N, B, Hkv, D], or a fused cache and None (``kv_layout``) (per-device head
        counts under ``shard_map``); ``slot_mapping``
        and ``block_tables`` address the layer's own pages. A byte cache: ``scales``
        (its [Hkv, D] key and value scales), or ``new_token`` ([T, Hkv] scale codes of k
        and v) and ``token`` (every layer's codes [L, N, B, Hkv]), which come back
        written; ``()`` where absent.
        """
        k_scale, v_scale = scales or (None, None)
        results = write_and_attend(
            q, k, v, slot_mapping, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
            num_seqs, layer=layer, sm_scale=self.cfg.softmax_scale,
            sliding_window=self.cfg.window(layer), soft_cap=self.cfg.attn_softcap,
            backend=self.attention_backend,
            kv_format=self.kv_format, k_scale=k_scale, v_scale=v_scale,
            new_token_scales=new_token or None, token_scales=token or None)
        return results if token else (*results, ())

    def _sharded(self, attention):
        """``attention`` under ``shard_map`` over the KV-head axis when there is a mesh."""
        if self.mesh is None:
            return attention
        heads, pages, whole = P(None, TP, None), P(None, None, None, TP), P()
        scale = P(TP, None)  # a byte cache's [Hkv, D] scales of the layer
        new_code = P(None, TP)  # per-token scale codes [T, Hkv] (their caches: pages)

        def sharded(*args, layer: int):
            scales, new_token, token = args[10:]
            v_pages = None if args[4] is None else pages  # None: a fused cache
            codes = (pages,) * len(token)
            return jax.shard_map(
                functools.partial(attention, layer=layer), mesh=self.mesh,
                in_specs=(heads, heads, heads, pages, v_pages, whole, whole, whole, whole,
                          whole, (scale,) * len(scales), (new_code,) * len(new_token), codes),
                out_specs=(heads, pages, v_pages, codes), check_vma=False)(*args)

        return sharded

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        """input_ids int32 [T] -> embeddings [T, hidden] in the model dtype."""
        if isinstance(self.embed, QuantizedWeight):
            h = gather_columns(self.embed.parts(), input_ids, self.final_norm[...].dtype)
        else:
            h = self.embed[...][input_ids]
        if self.cfg.embed_scale is not None:  # in the model dtype, as Hugging Face rounds it
            h = h * jnp.asarray(self.cfg.embed_scale, h.dtype)
        return h

    def compute_logits(self, hidden: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]. ``rows`` (int32
        scalar): the rows past it are padding, their logits unspecified."""
        if not self.cfg.tie_word_embeddings:
            logits = linear(hidden, self.lm_head, self.matmul_backend, rows)
        elif isinstance(self.embed, QuantizedWeight):
            logits = linear(hidden, self.embed, self.matmul_backend, rows)
        else:
            logits = project("nh,vh->nv", hidden, self.embed[...])
        logits = logits.astype(jnp.float32)
        if self.cfg.final_softcap is not None:
            logits = jnp.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits
