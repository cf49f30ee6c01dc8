"""Every Pallas kernel compiled for real TPU and GPU targets, without the hardware.

libtpu (Mosaic) and the CUDA plugin (Triton -> PTX -> cubin) compile each kernel for
devices described in software (``jaxpage.parallel.targets``); a kernel that a compiler
rejects (a layout Mosaic cannot tile, VMEM or shared memory overflow, a Triton shape
error) fails here. Interpret mode (``tests/kernels``) checks the numbers; this checks
that the same kernels are real programs for the chips we serve.

The matrix is chosen by what changes the compiled program: the target generation, the
dtype (bfloat16 packs two rows per TPU sublane), head_dim (lanes), the number of kv
heads (the page buffer's tiled dimension) and the GQA ratio (rows per tile), the block
size (the DMA and gather shapes), and decode- vs prefill-shaped batches (the query tile
size). Every target compiles every family (decode and prefill, plus the KV update);
the dtype and the block size rotate over the pairs so that each target and each family
sees both dtypes, and each target every block size, in 45 cases (the full product was
twice that for little more coverage). TPU targets compile the fused cache layout the
engine allocates there (``kv_layout``), including one KV head of 64 and of 256 lanes.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxpage.parallel.targets import compile_on_device, single_device_spec, target_devices
from pallas_kernels import kv_layout
from pallas_kernels.kv_cache_update.gpu import kv_cache_update_gpu
from pallas_kernels.kv_cache_update.tpu import kv_cache_update_fused_tpu
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from tests.default_suite import SLOW

TARGETS = ["v5e:1x1", "v6e:1x1", "v5p:2x2x1", "h100", "a100"]
FAMILIES = {  # name -> (num_q_heads, num_kv_heads, head_dim, options)
    "smollm2": (9, 3, 64, {}),                      # GQA 3, head_dim 64
    "llama3_8b": (32, 8, 128, {}),                  # GQA 4
    "llama3_8b_tp8": (4, 1, 128, {}),               # one device's share at TP=8
    "qwen2_7b": (28, 4, 128, {}),                   # GQA 7
    "llama2_mha": (32, 32, 128, {}),                # GQA 1
    "llama3_70b": (64, 8, 128, {}),                 # GQA 8
    "mistral_window": (32, 8, 128, dict(sliding_window=512, soft_cap=30.0)),
    "gemma_d256_tp8": (2, 1, 256, dict(soft_cap=50.0)),  # head_dim 256, one KV head
    "llama32_1b_tp8": (4, 1, 64, {}),               # head_dim 64, one KV head per device
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
BLOCK_SIZES = (16, 32, 64)
MAX_MODEL_LEN = 4096
NUM_BLOCKS = 512
BATCHES = {"decode": (64, 64), "prefill": (512, 8)}  # (tokens, sequences)


# head_dim 256 in float32 at block 64 overflowed the Triton kernel's shared memory on GPUs
# (278,784 of 232,448 bytes on an H100) until ``gpu_config.fit_shared_memory`` sized the
# pipeline to the device: every family rotates over every target (the rotation gives the
# H100 exactly that case, gemma_d256_tp8-f32-b64, a slow one; the A100's is sized in
# tests/kernels/test_attention_kernels.py::test_gpu_tuning_table_is_read).


TPU_TARGETS = [t for t in TARGETS if t[0] == "v"]
GPU_TARGETS = [t for t in TARGETS if t[0] != "v"]


def _in_default_suite(target: str, family_index: int) -> bool:
    """The default suite compiles every family for one target: a TPU for half of them,
    rotating over the generations, an A100 or an H100 for the others (picked so that each
    gets its dtype, bfloat16); the whole matrix runs with the slow cases
    (``make test-all``)."""
    slot = family_index % 4
    if slot in (1, 2):
        return target == ("a100" if slot == 1 else "h100")
    tpu_families_before = sum(1 for j in range(family_index) if j % 4 in (0, 3))
    return TPU_TARGETS[tpu_families_before % len(TPU_TARGETS)] == target


def _cases():
    for ti, target in enumerate(TARGETS):
        for fi, family in enumerate(FAMILIES):
            dtype = list(DTYPES)[(ti + fi) % len(DTYPES)]
            block_size = BLOCK_SIZES[(ti + 2 * fi) % len(BLOCK_SIZES)]
            case_id = f"{target}-{family}-{dtype}-b{block_size}"
            # float32 on a GPU compiles for 10-40 s a case (bf16 is the GPU's dtype): those
            # run with the slow cases
            slow = not _in_default_suite(target, fi) or (target in GPU_TARGETS
                                                           and dtype == "f32")
            yield pytest.param(target, family, dtype, block_size, id=case_id,
                               marks=[pytest.mark.slow] if slow else [])


def _caches(on_tpu, hkv, head_dim, block_size, dtype):
    """(k_cache, v_cache) specs in the target's layout: fused rows and None on TPUs."""
    if on_tpu:
        return ((NUM_BLOCKS, block_size, kv_layout.row_width(hkv, head_dim)), dtype), None
    cache = ((NUM_BLOCKS, block_size, hkv, head_dim), dtype)
    return cache, cache


def _attention_specs(num_tokens, num_seqs, hq, hkv, head_dim, block_size, dtype, on_tpu):
    max_blocks = MAX_MODEL_LEN // block_size
    return [((num_tokens, hq, head_dim), dtype),
            *_caches(on_tpu, hkv, head_dim, block_size, dtype), ((num_seqs,), jnp.int32),
            ((num_seqs, max_blocks), jnp.int32), ((num_seqs + 1,), jnp.int32),
            ((1,), jnp.int32)]


@pytest.mark.parametrize("target,family,dtype_name,block_size", list(_cases()))
def test_kernels_compile_for_target(target, family, dtype_name, block_size):
    device = target_devices(target)[0]
    hq, hkv, head_dim, options = FAMILIES[family]
    dtype = DTYPES[dtype_name]
    on_tpu = device.platform == "tpu"
    attention = ragged_paged_attention_tpu if on_tpu else ragged_paged_attention_gpu
    for kind, (num_tokens, num_seqs) in BATCHES.items():
        compiled = compile_on_device(
            device, attention,
            *_attention_specs(num_tokens, num_seqs, hq, hkv, head_dim, block_size, dtype,
                              on_tpu),
            static_kwargs=dict(sm_scale=head_dim ** -0.5, **options))
        assert compiled.memory_analysis() is not None, kind
    update = kv_cache_update_fused_tpu if on_tpu else kv_cache_update_gpu
    new = ((64, hkv, head_dim), dtype)
    compile_on_device(device, update, *_caches(on_tpu, hkv, head_dim, block_size, dtype),
                      new, new, ((64,), jnp.int32))


def test_a_page_too_large_for_shared_memory_falls_back_on_auto_and_is_refused_on_gpu():
    """float32, head_dim 256, 128-token pages: one page of K and V is 256 KiB, more than an
    H100 block may hold, and the kernel loads whole pages. ``backend="auto"`` compiles the
    reference for it; ``backend="gpu"`` raises a ValueError naming the need and the limit
    (Triton failed to compile it before, from inside jit)."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    device = target_devices("h100")[0]
    specs = [((8, 2, 256), jnp.float32), ((16, 128, 1, 256), jnp.float32),
             ((16, 128, 1, 256), jnp.float32), ((8,), jnp.int32), ((8, 4), jnp.int32),
             ((9,), jnp.int32), ((1,), jnp.int32)]
    compiled = compile_on_device(device, ragged_paged_attention, *specs,
                                 static_kwargs=dict(sm_scale=0.0625, backend="auto"))
    assert "__gpu$xla.gpu.triton" not in compiled.as_text()   # no Pallas call: the reference
    with pytest.raises(ValueError, match=r"needs 278,528 bytes of shared memory.*block_size"):
        compile_on_device(device, ragged_paged_attention, *specs,
                          static_kwargs=dict(sm_scale=0.0625, backend="gpu"))
    # bfloat16 pages of the same shape fit (128 KiB of K and V)
    bf16 = [(shape, jnp.bfloat16 if dtype == jnp.float32 else dtype) for shape, dtype in specs]
    compiled = compile_on_device(device, ragged_paged_attention, *bf16,
                                 static_kwargs=dict(sm_scale=0.0625, backend="gpu"))
    assert "__gpu$xla.gpu.triton" in compiled.as_text()   # the Pallas kernel


KV_FORMAT_CASES = [("v5e:1x1", "int8", "llama3_8b", 16), ("v6e:1x1", "fp8_e4m3", "smollm2", 32),
                   ("v5p:2x2x1", "fp8_e5m2", "qwen2_7b", 64), ("h100", "fp8_e4m3", "llama3_8b", 16),
                   ("a100", "int8", "smollm2", 32), ("v5e:1x1", "fp8_e4m3", "gemma_d256_tp8", 16),
                   ("v6e:1x1", "int8", "llama32_1b_tp8", 16),
                   ("v5p:2x2x1", "int8", "gemma_d256_tp8", 32),  # codes in value bytes
                   # an A100's Triton converts no FP8 (a fatal error that ended the process
                   # until the kernel built e4m3 values from the bytes' fields there)
                   ("a100", "fp8_e4m3", "llama3_8b_tp8", 32)]


# In the default suite: each format on a TPU, an H100's and an A100's FP8, and the codes in
# value bytes; the rest with the slow cases.
KV_FORMAT_DEFAULT = {0, 2, 3, 7, 8}


@pytest.mark.parametrize("target,kv_format,family,block_size", [
    pytest.param(*case, marks=[] if i in KV_FORMAT_DEFAULT else SLOW)
    for i, case in enumerate(KV_FORMAT_CASES)],
                         ids=[f"{t}-{f}-{m}-b{b}" for t, f, m, b in KV_FORMAT_CASES])
def test_byte_kv_cache_kernels_compile_for_target(target, kv_format, family, block_size):
    """int8 / fp8 KV (uint8 pages converted as they load, ``kv_quant``), bfloat16 queries."""
    device = target_devices(target)[0]
    hq, hkv, head_dim, options = FAMILIES[family]
    on_tpu = device.platform == "tpu"
    attention = ragged_paged_attention_tpu if on_tpu else ragged_paged_attention_gpu
    for kind, (num_tokens, num_seqs) in BATCHES.items():
        specs = _attention_specs(num_tokens, num_seqs, hq, hkv, head_dim, block_size, jnp.uint8,
                                 on_tpu)
        specs[0] = ((num_tokens, hq, head_dim), jnp.bfloat16)
        compiled = compile_on_device(device, attention, *specs, static_kwargs=dict(
            sm_scale=head_dim ** -0.5, kv_format=kv_format, **options))
        assert compiled.memory_analysis() is not None, kind
    update = kv_cache_update_fused_tpu if on_tpu else kv_cache_update_gpu
    new = ((64, hkv, head_dim), jnp.uint8)
    compile_on_device(device, update, *_caches(on_tpu, hkv, head_dim, block_size, jnp.uint8),
                      new, new, ((64,), jnp.int32))


@pytest.mark.parametrize("target,family,block_size", [("h100", "llama3_8b", 16),
                                                       ("a100", "smollm2", 32)])
def test_token_scaled_int8_kernel_compiles_for_gpu(target, family, block_size):
    """int8 KV with per-token scale codes (``kv_token_scale``), every layer's cache read at
    one layer: the Triton kernel loads each page's codes with it."""
    device = target_devices(target)[0]
    hq, hkv, head_dim, options = FAMILIES[family]
    for kind, (num_tokens, num_seqs) in BATCHES.items():
        specs = _attention_specs(num_tokens, num_seqs, hq, hkv, head_dim, block_size, jnp.uint8,
                                 False)
        specs[0] = ((num_tokens, hq, head_dim), jnp.bfloat16)
        specs[1] = specs[2] = ((2,) + specs[1][0], jnp.uint8)           # [L, N, B, Hkv, D]
        codes = (specs[1][0][:-1], jnp.uint8)
        compiled = compile_on_device(
            device, lambda *a: ragged_paged_attention_gpu(
                *a[:7], token_scales=a[7:], layer=1, sm_scale=head_dim ** -0.5,
                kv_format="int8", **options), *specs, codes, codes)
        assert "__gpu$xla.gpu.triton" in compiled.as_text(), kind


@pytest.mark.parametrize("target,kv_format", [("h100", "fp8_e4m3"), ("h100", "int8"),
                                              ("h100", "fp8_e5m2"), ("a100", "int8")])
def test_byte_pages_multiplied_in_float16_compile(target, kv_format):
    """Byte pages converted to float16 and multiplied in float16 (``half_products``; int8
    and e5m2 through inline PTX, int8 with its token scales as the engine stores it),
    decode and prefill batches at Llama-3-8B's heads: the Triton kernel compiles."""
    device = target_devices(target)[0]
    hq, hkv, head_dim, options = FAMILIES["llama3_8b"]
    for kind, (num_tokens, num_seqs) in BATCHES.items():
        specs = _attention_specs(num_tokens, num_seqs, hq, hkv, head_dim, 16, jnp.uint8,
                                 False)
        specs[0] = ((num_tokens, hq, head_dim), jnp.bfloat16)
        codes = [((specs[1][0][0], 16, hkv), jnp.uint8)] * 2 if kv_format == "int8" else []

        def attend(*args):
            return ragged_paged_attention_gpu(
                *args[:7], token_scales=tuple(args[7:]) or None, sm_scale=head_dim ** -0.5,
                kv_format=kv_format, half_products=True, **options)

        compiled = compile_on_device(device, attend, *specs, *codes)
        assert "_f16" in compiled.as_text(), kind   # the float16 kernel, by its name


def test_int8_queries_times_int8_key_codes_compile_for_an_h100():
    """int8 query codes times int8 key codes on integer tensor cores (``int8_queries``),
    a decode batch at Llama-3-8B's heads with token scales: the Triton kernel compiles
    (its PTX: ``mma...s32.s8.s8.s32`` for the scores, ``scripts/kernel_ptx_ops.py``)."""
    device = target_devices("h100")[0]
    hq, hkv, head_dim, options = FAMILIES["llama3_8b"]
    num_tokens, num_seqs = BATCHES["decode"]
    specs = _attention_specs(num_tokens, num_seqs, hq, hkv, head_dim, 16, jnp.uint8, False)
    specs[0] = ((num_tokens, hq, head_dim), jnp.bfloat16)
    num_blocks = specs[1][0][0]
    codes = ((num_blocks, 16, hkv), jnp.uint8)

    def attend(q, k, v, *rest_and_codes):
        *rest, k_codes, v_codes = rest_and_codes
        return ragged_paged_attention_gpu(q, k, v, *rest, sm_scale=head_dim ** -0.5,
                                          kv_format="int8", int8_queries=True,
                                          token_scales=(k_codes, v_codes), **options)

    compiled = compile_on_device(device, attend, *specs, codes, codes)
    assert "_q8" in compiled.as_text()   # the int8-query kernel, by its name
    # with float16 values (``half_products`` applies to the values only there)
    def attend_in_halves(*args):
        return ragged_paged_attention_gpu(*args[:7], sm_scale=head_dim ** -0.5,
                                          kv_format="int8", int8_queries=True,
                                          half_products=True, token_scales=args[7:], **options)

    compiled = compile_on_device(device, attend_in_halves, *specs, codes, codes)
    assert "_q8" in compiled.as_text() and "_f16" in compiled.as_text()


@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_matmul_compiles_for_target(target, bits):
    """Weight-only int8 / int4 (Llama-3-8B's MLP shape): the jnp form XLA fuses on devices."""
    from pallas_kernels.quantized_matmul import quantized_matmul

    device = target_devices(target)[0]
    k, n, groups = 4096, 14336, 32
    codes = ((k, n), jnp.int8) if bits == 8 else ((k // 2, n), jnp.uint8)
    parts = [codes, ((groups, n), jnp.float32)] + ([((groups, n), jnp.float32)] if bits == 4 else [])

    def matmul(x, *weight):
        names = ("codes", "scale", "zero")[:len(weight)]
        return quantized_matmul(x, dict(zip(names, weight)))

    compiled = compile_on_device(device, matmul, ((64, k), jnp.bfloat16), *parts)
    stats = compiled.memory_analysis()
    assert stats is not None


@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
@pytest.mark.parametrize("tokens", [8, 256])  # decode (gathered on a CPU only) and prefill
def test_moe_experts_compile_for_target(target, tokens):
    """The mixture-of-experts MLP (Mixtral-8x7B's expert shape, bfloat16): routing and the
    grouped ``ragged_dot`` matmuls as the target's compiler takes them."""
    import jax

    from jaxpage.models.moe import moe_mlp

    device = target_devices(target)[0]
    hidden, width, experts = 4096, 14336, 8

    def mlp(x, router, gate, up, down):
        return moe_mlp(x, router, gate, up, down, k=2, normalize=True, act=jax.nn.silu)

    bf16 = jnp.bfloat16
    specs = [((tokens, hidden), bf16), ((hidden, experts), bf16),
             ((experts, hidden, width), bf16), ((experts, hidden, width), bf16),
             ((experts, width, hidden), bf16)]
    compiled = compile_on_device(device, mlp, *specs)
    assert compiled.memory_analysis() is not None
    with jax.default_device(device):  # on a device the experts are grouped matmuls
        lowered = jax.jit(mlp).lower(*[single_device_spec(device, *spec) for spec in specs])
    assert "ragged_dot" in lowered.as_text()


# (target, codes dtype, activation scheme) -> what the compiled matmul must multiply
W8A8_CASES = [
    ("h100", "float8_e4m3fn", "dynamic", "f8e4m3fn"),  # FP8 tensor cores
    ("h100", "float8_e4m3fn", "static", "f8e4m3fn"),
    ("a100", "float8_e4m3fn", "dynamic", "bf16"),      # no FP8 units: weight-only
    ("h100", "int8", "dynamic", "s8"),
    ("v5e:1x1", "int8", "dynamic", "s8"),              # the MXU's int8
    ("v6e:1x1", "int8", "dynamic", "s8"),
    ("v5e:1x1", "float8_e4m3fn", "dynamic", "bf16"),   # no FP8 units: weight-only
]


@pytest.mark.parametrize("target,codes_dtype,scheme,operand", W8A8_CASES,
                         ids=[f"{t}-{c}-{s}" for t, c, s, _ in W8A8_CASES])
def test_w8a8_matmul_multiplies_codes_where_the_chip_can(target, codes_dtype, scheme, operand):
    """A W8A8 checkpoint's matmul (Llama-3-8B's MLP shape, 256 tokens), its codes laid
    out as the loader gives them for the target (``prequantized.for_device``: ``[out, in]``
    where a GPU multiplies them), compiles, and its dot multiplies ``operand`` values: the
    8-bit codes themselves where the chip has units for them (FP8 on an H100, int8 on TPUs
    and GPUs), the model dtype (weight-only) elsewhere (``activation_quant``). Where the
    codes are multiplied, nothing transposes them (codes ``[in, out]`` on an H100 were
    transposed on every call: 6.6 GiB hoisted out of an FP8 Llama-3-8B's decode loop)."""
    import re

    from jaxpage.models.prequantized import for_device
    from jaxpage.models.quantize import QuantFormat
    from pallas_kernels.quantized_matmul import quantized_matmul

    device = target_devices(target)[0]
    k, n = 4096, 14336
    fmt = for_device({"up_proj": QuantFormat(
        8, None, "fp8" if codes_dtype.startswith("float8") else "int", activations=scheme)},
        device)["up_proj"]
    part = "codes_t" if fmt.transposed else "codes"

    def matmul(x, codes, scale, input_scale):   # as a compressed-tensors checkpoint runs:
        # weight-only rows round x to its codes and back first (QuantFormat.emulated)
        return quantized_matmul(x, {part: codes, "scale": scale}, activations=scheme,
                                input_scale=input_scale, emulate=True)

    shape = (n, k) if fmt.transposed else (k, n)
    compiled = compile_on_device(device, matmul, ((256, k), jnp.bfloat16),
                                 (shape, jnp.dtype(codes_dtype)), ((1, n), jnp.float32),
                                 ((1,), jnp.float32))
    assert fmt.transposed == (target == "h100" or (target == "a100" and codes_dtype == "int8"))
    # weight-only or not, the codes are read as stored: no dequantized copy of the weight.
    # Except FP8 on an A100: XLA:GPU converts FP8 to bf16 outside the GEMM on a chip
    # without FP8 (a 112 MiB copy here; docs/quantization.md)
    copies = target == "a100" and codes_dtype.startswith("float8")
    assert (compiled.memory_analysis().temp_size_in_bytes >= k * n) == copies
    text = compiled.as_text()
    if operand != "bf16":
        codes_type = "f8e4m3fn" if codes_dtype.startswith("float8") else "s8"
        assert not re.search(rf"= {codes_type}\[({k},{n}|{n},{k})\]\S* transpose\(", text)
    # the operands of every dot / convolution, by their HLO names -> types
    types = dict(re.findall(r"%(\S+) = (\w+)\[", text))
    operands = {types.get(name) for line in text.splitlines()
                if re.search(r" (dot|convolution)\(", line)
                for name in re.findall(r"[(,] ?%([\w.-]+)", line.split("(", 1)[1])[:2]}
    assert operand in operands, (target, codes_dtype, operands)


@pytest.mark.parametrize("target", ["v5e:1x1", "v6e:1x1"])
@pytest.mark.parametrize("bits,zero", [(8, True), (8, False), (4, True)])
@pytest.mark.parametrize("tokens", [1, 256])
def test_grouped_weight_only_matmul_reads_the_codes_in_place_on_tpus(target, bits, zero, tokens):
    """Group-scaled weights (int8 / int4, groups of 32; Llama-3-8B's MLP shape) through
    ``quantized_matmul`` on a TPU take the Pallas kernel (``tpu.py``), which dequantizes
    tiles in VMEM: no temporaries. The jnp form held a float32 copy of the weight (224 MiB)."""
    from pallas_kernels.quantized_matmul import quantized_matmul

    device = target_devices(target)[0]
    k, n, groups = 4096, 14336, 4096 // 32
    codes = ((k, n), jnp.int8) if bits == 8 else ((k // 2, n), jnp.uint8)
    names = ("codes", "scale", "zero")[:3 if zero else 2]

    def matmul(x, *parts):
        return quantized_matmul(x, dict(zip(names, parts)))

    compiled = compile_on_device(device, matmul, ((tokens, k), jnp.bfloat16), codes,
                                 *[((groups, n), jnp.float32)] * (len(names) - 1))
    assert compiled.memory_analysis().temp_size_in_bytes < 2**20
    assert "tpu_custom_call" in compiled.as_text()


GROUPED_GPU_CASES = [  # (codes, group, K, N): Llama-3-8B's up (and down) / k projections
    ("int8", 32, 4096, 14336), ("int4", 128, 14336, 4096), ("fp8", 128, 4096, 1024)]


@pytest.mark.parametrize("target", ["h100", "a100"])
@pytest.mark.parametrize("codes_name,group,k,n", GROUPED_GPU_CASES,
                         ids=[f"{c}-g{g}-{k}x{n}" for c, g, k, n in GROUPED_GPU_CASES])
@pytest.mark.parametrize("tokens", [1, 256])
def test_grouped_weight_only_matmul_reads_the_codes_in_place_on_gpus(target, codes_name, group,
                                                                     k, n, tokens):
    """Group-scaled weights (our int8: groups of 32 with a zero; AWQ / GPTQ int4: groups of
    128, a K of 14,336 that is no power of two; block FP8: groups of 128 on a 1,024-wide
    projection, whose few column tiles split K) through ``quantized_matmul`` on a GPU take
    the Pallas Triton kernel (``gpu.py``), which dequantizes tiles in registers: no copy of
    the weight (the jnp form held 112 MiB of bf16 for the MLP weights; 4-bit splits x's
    even and odd columns, a split K adds float32 partials)."""
    from pallas_kernels.quantized_matmul import quantized_matmul

    device = target_devices(target)[0]
    codes = {"int8": ((k, n), jnp.int8), "int4": ((k // 2, n), jnp.uint8),
             "fp8": ((k, n), jnp.float8_e4m3fn)}[codes_name]
    names = ("codes", "scale", "zero")[:2 if codes_name == "fp8" else 3]

    def matmul(x, *parts):
        return quantized_matmul(x, dict(zip(names, parts)))

    compiled = compile_on_device(device, matmul, ((tokens, k), jnp.bfloat16), codes,
                                 *[((k // group, n), jnp.float32)] * (len(names) - 1))
    if codes_name == "fp8" and target == "a100":  # Triton has no FP8 conversion there: the
        # jnp form (a fatal compiler error, not an exception, if the kernel were tried)
        assert "__gpu$xla.gpu.triton" not in compiled.as_text()
        return
    partials = 2**21 if tokens <= 64 else 0   # a decode-sized M's split-K partial sums
    assert compiled.memory_analysis().temp_size_in_bytes <= 2 * tokens * k * 2 + partials + 2**20
    assert compiled.memory_analysis().temp_size_in_bytes < k * n  # never the weight's bytes
    assert "__gpu$xla.gpu.triton" in compiled.as_text()
