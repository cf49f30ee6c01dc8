#!/usr/bin/env bash
# The one script for the first machine that has a GPU or TPU: run it first, in one call.
#
#   bash scripts/accelerator_check.sh                 # results under docs/benchmarks/accelerator/
#   RESULTS_DIR=$OUT bash scripts/accelerator_check.sh   # (the device tool: files come back from $OUT)
#
# It runs, on the real device:
#   1. the Pallas kernel tests compiled for the device (JAXPAGE_KERNELS_ON_DEVICE=1: the
#      device's own backend, not interpret mode) against the jnp reference;
#   2. scripts/bench_kernels.py: Llama-3-8B decode attention, batch 64, context 2048, bf16,
#      against the measured bandwidth (and JAX's shipped kernel on a GPU);
#   3. scripts/bench_throughput.py on preset:llama3-8b (random weights, token-id prompts),
#      bfloat16, jaxpage only;
# and writes each one's output, plus the device, the date, the versions and the commands,
# under RESULTS_DIR (default docs/benchmarks/accelerator/<date>-<device>/). Commit that folder.
#
# No install happens here (the lent machines have no network): run from the source tree
# with the machine's jax and PYTHONPATH=. ; a package it lacks (gguf, fastapi, uvicorn,
# pydantic, prometheus_client) travels as a wheel (the device tool's README says how).
# Each step's failure is recorded and the script goes on to the next.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

device=$("$PYTHON" -c 'import jax; d = jax.devices()[0]; print(d.device_kind.replace(" ", "-"))' 2>/dev/null || echo unknown)
stamp=$(date -u +%Y-%m-%d)
dir="${RESULTS_DIR:-docs/benchmarks/accelerator/${stamp}-${device}}"
mkdir -p "$dir"
summary="$dir/README.md"

run_step() {  # name, then the command; output to $dir/<name>.log, status to the summary
    local name=$1; shift
    echo "== $name: $*"
    local began=$(date +%s)
    "$@" > "$dir/$name.log" 2>&1
    local status=$?
    tail -n 25 "$dir/$name.log"
    echo "| $name | \`$*\` | $([ $status -eq 0 ] && echo ok || echo "FAILED ($status)") | $(( $(date +%s) - began )) s |" >> "$summary"
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

run_step kernel_tests env JAXPAGE_KERNELS_ON_DEVICE=1 "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_attention_kernels.py tests/kernels/test_kv_cache_update_kernels.py
run_step bench_kernels "$PYTHON" scripts/bench_kernels.py --markdown --json "$dir/bench_kernels.json"
run_step bench_throughput "$PYTHON" scripts/bench_throughput.py --model preset:llama3-8b \
    --dtype bfloat16 --systems jaxpage --workload random --max-num-seqs 64 \
    --out-dir "$dir" --no-progress

echo
cat "$summary"
