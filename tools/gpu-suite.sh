#!/usr/bin/env bash
# Runs the CUDA build's standalone executables on the GPU machine (no cargo
# there). Executables come xz-compressed in .device/ (written here from
# `cargo xtask build --cuda`'s <target>-cuda/standalone, carried by the device
# tool); they are unpacked to $BIN. Each step's output goes to stdout and to
# $OUT/<step>.log when $OUT is set.
#
#   tools/gpu-suite.sh STEP...
#
# Steps: kernels (kernel tests against the CPU reference), align (every golden
# fixture, f32 and bf16), bench (the 8-layer BerryLM-OS-shaped benchmark),
# paged (paged vs contiguous KV), invariance-paged / invariance-contiguous (the
# serving invariance tests with paged attention on / off), template (chat
# template and grammar-pinned tool calls).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-/tmp/berrylm-bin}"
mkdir -p "$BIN"
for packed in .device/*.xz; do
    [ -e "$packed" ] || continue
    name="$(basename "$packed" .xz)"
    [ -x "$BIN/$name" ] || { xz -dc "$packed" > "$BIN/$name" && chmod +x "$BIN/$name"; }
done
export LD_LIBRARY_PATH="${CUDA_RUNTIME_LIBS:-/usr/local/cuda-13.0/targets/x86_64-linux/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BERRYLM_HOST_BIN="$BIN/mistralrs" BERRYLM_FIXTURES="$PWD/tests/fixtures"
FIXTURES="tiny-hf small-hybrid small-hybrid-alt-layout small-hybrid-bf16 variant-a variant-b no-attnres trained-tiny"
status=0

log() { if [ -n "${OUT:-}" ]; then tee -a "$OUT/$1.log"; else cat; fi; }

step() {
    case "$1" in
    kernels) "$BIN/test-cuda" --test-threads 1 ;;
    align)
        for dtype in f32 bf16; do
            for f in $FIXTURES; do
                "$BIN/berrylm-align" --model "tests/fixtures/$f/model" \
                    --golden "tests/fixtures/$f/golden.safetensors" \
                    --dtype "$dtype" --device cuda ${OUT:+--json "$OUT/align-$f-$dtype.json"}
            done
        done ;;
    bench) "$BIN/berrylm-bench" --device cuda --dtype bf16 --layers 8 \
        --prefill 512,4096,16384 --decode 1,8,64 ${OUT:+--json "$OUT/bench.json"} ;;
    paged) "$BIN/test-server_paged" --ignored --test-threads 1 ;;
    invariance-paged) BERRYLM_SERVER_ARGS="--paged-attn on --pa-memory-mb 1024" \
        "$BIN/test-server_invariance" --test-threads 1 ;;
    invariance-contiguous) BERRYLM_SERVER_ARGS="--paged-attn off" \
        "$BIN/test-server_invariance" --test-threads 1 ;;
    template) BERRYLM_SERVER_ARGS="--paged-attn on --pa-memory-mb 1024" \
        "$BIN/test-server_chat_template" --test-threads 1 ;;
    *) echo "unknown step $1" >&2; return 2 ;;
    esac
}

for name in "$@"; do
    echo "=== $name ($(date -u +%T))" | log "$name"
    step "$name" 2>&1 | log "$name"
    code=${PIPESTATUS[0]}
    echo "=== $name exit $code ($(date -u +%T))" | log "$name"
    [ "$code" -eq 0 ] || status=1
done
exit $status
