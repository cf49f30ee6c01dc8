#!/usr/bin/env bash
# The one script for the first machine that has a GPU or TPU: run it first, in one call.
#
#   bash scripts/accelerator_check.sh                 # results under docs/benchmarks/accelerator/
#   RESULTS_DIR=$OUT bash scripts/accelerator_check.sh   # (the device tool: files come back from $OUT)
#   STEPS="kernel_tests bench_kernels" bash scripts/accelerator_check.sh   # some steps only
#
# On a lent machine without network, the packages its image lacks travel as wheels: build
# them here first with `bash scripts/device_wheels.sh` (into .whl/, carried with the call).
#
# It runs, on the real device, each step under a time limit (STEP_TIMEOUT seconds, default
# 300; TIMEOUT_<step> for one step, e.g. TIMEOUT_kernel_tests=200), a failing or timed-out
# step recorded and the next one run:
#   tune_attention    issue [18]: scripts/tune_gpu_attention.py: the copy bandwidth and bf16
#                     matrix rate, the Pallas GPU attention kernel's tilings searched and
#                     timed at Llama-3-8B decode shapes (64 x 2,048, 8 x 16,384, 256 x 512;
#                     bf16, int8, fp8 KV) against JAX's shipped kernel, and prefill chunks in
#                     TFLOP/s (bf16 decode first, then prefill, then the byte formats); writes
#                     gpu_tuned.json, which the later steps read (JAXPAGE_GPU_ATTENTION_TUNING;
#                     TUNE_BUDGET seconds of search, default 150; TUNE_ARGS more flags, e.g.
#                     "--no-search" to time the committed table only, in about a minute);
#   step_phases       issue [18]: scripts/bench_step_phases.py on preset:llama3-8b: the
#                     64 x (1,024 + 128) run split into prefill (against the FLOP bound) and
#                     decode (weights + KV at the copy bandwidth), batch-1 decode against the
#                     weights floor, the device-idle fraction for greedy and top-p rows, and a
#                     jax.profiler trace's device time by kernel, and a batch-1 trace's
#                     kernels per token, device-busy fraction and launch gaps;
#   batch1_flags      issue [18]: batch-1 decode alone (bench_step_phases.py, 1 request under
#                     a 64-sequence engine) once per XLA_FLAGS variant, default, command
#                     buffers (CUDA graphs) off, and on for loops and conditionals too,
#                     and mlp_unmerged (the decode programs' gate and up as two GEMMs,
#                     XLA's default; runtime/compiler_options.py)
#                     (BATCH1_VARIANTS: names of the variants below, default all four): whether batch 1's
#                     1.35x of the weights floor is launch costs that graphs remove;
#                     one json per variant (not in the default steps);
#   startup           issue [16]: LLM("preset:llama3-8b", dtype="bfloat16") to its first token,
#                     cold (empty cache) and warm (scripts/bench_startup.py), then
#                     bench_throughput.py's 64 x (1,024 + 128) random run started cold
#                     (--warmup ready) and with every program built first (--warmup buckets,
#                     loaded from the cache the cold run filled); raise TIMEOUT_startup
#                     (~500 s) when the other steps are skipped;
#   host_overhead     scripts/bench_host_overhead.py on the device: host microseconds per engine
#                     call by phase and the fraction of wall time the device waits for the
#                     host, tiny preset, K=1 and K=8 (HOST_RUNNING, default 16,256,1024;
#                     HOST_WAITING, default 0,10000; HOST_REPEATS, default 5);
#   kernel_tests      the GPU attention kernel's tests (and its tunings', byte caches too)
#                     compiled for the device (JAXPAGE_KERNELS_ON_DEVICE=1: not interpret mode)
#                     against the jnp reference, over KERNEL_TEST_WORKERS processes (pytest-xdist);
#   kernel_tests_all  every Pallas kernel test file so compiled (not in the default steps);
#   bench_kernels     scripts/bench_kernels.py: Llama-3-8B decode attention, batch 64, context
#                     2048, bf16, against the measured bandwidth (and JAX's shipped kernel on a GPU);
#   engine_vs_hf      the engine on the device against Hugging Face (PyTorch CPU, float32): greedy
#                     tokens and logits of the tiny random checkpoints. Needs SmolLM2's tokenizer:
#                     the embedded GGUF, or a tokenizer directory in JAXPAGE_TEST_TOKENIZER;
#   bench_throughput  scripts/bench_throughput.py on preset:llama3-8b (random weights, token-id
#                     prompts), bfloat16, jaxpage only (THROUGHPUT_REQUESTS requests, default 500);
#   bench_spec_decode scripts/bench_spec_decode.py on preset:llama3-8b, bfloat16, batch 1, 4, 32
#                     (n-gram speculation against plain decoding);
#   bench_sampler     scripts/bench_sampler.py at Llama-3's vocabulary (128,256) and SmolLM2's:
#                     the top-k / top-p cut by sort (what GPUs and TPUs use) against the
#                     bisection (what CPUs use; runtime/cut_threshold.py), side by side;
#   bench_quantized   issue [21]: scripts/bench_quantized_matmul.py, one Llama-3-8B layer's
#                     projections at 1 / 64 / 512 / 2,048 tokens: FP8 and int8 W8A8, FP8
#                     weight-only, int8 / int4 groups, against bf16 side by side;
# and writes each one's output, plus the device, the date, the versions and the commands,
# under RESULTS_DIR (default docs/benchmarks/accelerator/<date>-<device>/). Commit that folder.
#
# No install happens here (the lent machines have no network): run from the source tree
# with the machine's jax and PYTHONPATH=. ; a package it lacks (gguf, fastapi, uvicorn,
# pydantic, prometheus_client) travels as a wheel (the device tool's README says how).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-tune_attention step_phases kernel_tests startup host_overhead bench_kernels engine_vs_hf bench_throughput bench_spec_decode bench_quantized bench_sampler}"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
# The tests and benchmark scripts default to the CPU; here the device's own platform runs.
if command -v nvidia-smi >/dev/null 2>&1; then export JAX_PLATFORMS=cuda; else export JAX_PLATFORMS=tpu; fi

device=$("$PYTHON" -c 'import jax; d = jax.devices()[0]; print(d.device_kind.replace(" ", "-"))' 2>/dev/null || echo unknown)
stamp=$(date -u +%Y-%m-%d)
dir="${RESULTS_DIR:-docs/benchmarks/accelerator/${stamp}-${device}}"
mkdir -p "$dir"
summary="$dir/README.md"

run_step() {  # name, then the command; output to $dir/<name>.log, status to the summary
    local name=$1; shift
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local limit_var="TIMEOUT_$name"
    local limit="${!limit_var:-$STEP_TIMEOUT}"
    echo "== $name (limit $limit s): $*"
    local began=$(date +%s)
    timeout "$limit" "$@" > "$dir/$name.log" 2>&1
    local status=$?
    tail -n 25 "$dir/$name.log"
    local result=ok
    [ $status -eq 124 ] && result="TIMED OUT (${limit} s)"
    [ $status -ne 0 ] && [ $status -ne 124 ] && result="FAILED ($status)"
    echo "| $name | \`$*\` | $result | $(( $(date +%s) - began )) s |" >> "$summary"
    return 0
}

{
    echo "# Accelerator check: $device, $stamp"
    echo
    echo "Written by \`scripts/accelerator_check.sh\` (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))."
    echo
    echo '```'
    "$PYTHON" -c 'import jax, jaxlib, sys; print("python", sys.version.split()[0]); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print("devices", jax.devices())' 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    echo '```'
    echo
    echo "| step | command | result | time |"
    echo "|---|---|---|---|"
} > "$summary"

# Issue [18]: the attention kernel tuned and timed first; the steps after it read its table.
run_step tune_attention "$PYTHON" scripts/tune_gpu_attention.py --budget-s "${TUNE_BUDGET:-150}" \
    --json "$dir/tune_attention.json" --tuning-out "$dir/gpu_tuned.json" ${TUNE_ARGS:-}
if [ -s "$dir/gpu_tuned.json" ]; then
    export JAXPAGE_GPU_ATTENTION_TUNING="$(realpath "$dir/gpu_tuned.json")"
fi
run_step step_phases "$PYTHON" scripts/bench_step_phases.py --model preset:llama3-8b \
    --dtype bfloat16 --json "$dir/step_phases.json" --trace-dir "${TRACE_DIR:-$(mktemp -d)}"
# batch 1 under XLA flag variants (each a process of its own: XLA reads its flags once)
export FLAGS_default=""
export FLAGS_no_graphs="--xla_gpu_enable_command_buffer="
export FLAGS_graphs_all="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
# variants that set an environment variable instead (ENV_<variant>, "NAME=value")
export FLAGS_mlp_unmerged="" ENV_mlp_unmerged="JAXPAGE_GPU_DECODE_DOT_MERGER_MB=32"
export BATCH1_DIR="$dir"
run_step batch1_flags bash -c '
    status=0
    for variant in ${BATCH1_VARIANTS:-default no_graphs graphs_all mlp_unmerged}; do
        name="FLAGS_$variant" env_name="ENV_$variant"
        flags="${XLA_FLAGS:+$XLA_FLAGS }${!name}"
        echo "== $variant: XLA_FLAGS=$flags ${!env_name}"
        env ${!env_name} XLA_FLAGS="$flags" "$0" scripts/bench_step_phases.py --model preset:llama3-8b \
            --dtype bfloat16 --num-requests 1 --max-num-seqs 64 --input-len 1024 \
            --output-len 2 --top-p 0 --batch1-output 128 \
            --json "$BATCH1_DIR/batch1_$variant.json" || status=1
    done
    exit $status' "$PYTHON"
# each case compiles its kernel (~6 s there, on one core): spread the cases over worker
# processes where pytest-xdist is installed, each taking GPU memory as it needs it
workers=$("$PYTHON" -c 'import xdist' 2>/dev/null && echo "-n ${KERNEL_TEST_WORKERS:-8}")
run_step kernel_tests env JAXPAGE_KERNELS_ON_DEVICE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$PYTHON" -m pytest -q -x -p no:cacheprovider $workers \
    tests/kernels/test_attention_kernels.py tests/kernels/test_kv_quant.py \
    tests/kernels/test_half_products.py tests/kernels/test_int8_queries.py \
    -k "gpu or tuning or halves or float16 or queries"

# Issue [16]: an 8B model ready within a minute cold, 10 s warm (the second start loads);
# then the same 64 x (1,024 + 128) run started cold (ready set, the rest compiled in the
# background while it runs) against the run with every program built first (loaded from
# the cache the cold run filled).
export STARTUP_CACHE="${STARTUP_CACHE:-$(mktemp -d)}"
run_step startup bash -c '
    JAXPAGE_CACHE_DIR="$STARTUP_CACHE/a" "$0" scripts/bench_startup.py --model preset:llama3-8b \
        --dtype bfloat16 --scenarios default --warm-runs 1 --json "$1/startup.json" &&
    for warmup in ready buckets; do
        JAXPAGE_CACHE_DIR="$STARTUP_CACHE/b" "$0" scripts/bench_throughput.py \
            --model preset:llama3-8b --dtype bfloat16 --systems jaxpage --workload random \
            --num-requests 64 --input-len 1024 --output-len 128 --max-num-seqs 64 \
            --max-num-batched-tokens 1024 --warmup $warmup --out-dir "$1" \
            --name "startup-throughput-$warmup" --no-progress || exit 1
    done' "$PYTHON" "$dir"
run_step host_overhead "$PYTHON" scripts/bench_host_overhead.py \
    --running "${HOST_RUNNING:-16,256,1024}" --waiting "${HOST_WAITING:-0,10000}" --steps 1,8 \
    --repeats "${HOST_REPEATS:-5}" --out "$dir" --stem host_overhead
run_step kernel_tests_all env JAXPAGE_KERNELS_ON_DEVICE=1 "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_attention_kernels.py tests/kernels/test_kv_cache_update_kernels.py
run_step bench_kernels "$PYTHON" scripts/bench_kernels.py --markdown --json "$dir/bench_kernels.json"
run_step engine_vs_hf "$PYTHON" -m pytest -q -p no:cacheprovider -k "tiny" \
    tests/models/test_logits_match_hf.py tests/engine/test_greedy_matches_hf.py
run_step bench_throughput "$PYTHON" scripts/bench_throughput.py --model preset:llama3-8b \
    --dtype bfloat16 --systems jaxpage --workload random --max-num-seqs 64 \
    --num-requests "${THROUGHPUT_REQUESTS:-500}" --out-dir "$dir" --no-progress
run_step bench_spec_decode "$PYTHON" scripts/bench_spec_decode.py --model preset:llama3-8b \
    --dtype bfloat16 --num-kv-blocks 4096 --batches "${SPEC_BATCHES:-1,4,32}" --max-tokens 128 --allow-mismatch \
    --out "$dir" --stem spec_decode_llama3-8b
run_step bench_quantized "$PYTHON" scripts/bench_quantized_matmul.py \
    --tokens "${QUANT_TOKENS:-1,64,512,2048}" --json "$dir/bench_quantized.json"
run_step bench_sampler "$PYTHON" scripts/bench_sampler.py \
    --shapes "${SAMPLER_SHAPES:-1x128256,64x128256,256x128256,48x49152}"

echo
cat "$summary"
