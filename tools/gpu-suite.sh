#!/usr/bin/env bash
# Runs the CUDA build's standalone executables on the GPU machine (no cargo
# there). Executables come zstd- or xz-compressed in $PACKED (default .device/, from
# `cargo xtask build --cuda`'s <target>-cuda/standalone, carried by the device
# tool); they are unpacked to $BIN, which keeps them between calls while the
# machine stays warm (so large ones can travel in separate calls). Each step's output goes to stdout and to
# $OUT/<step>.log when $OUT is set.
#
#   tools/gpu-suite.sh STEP...
#
# Steps: kernels (kernel tests against the CPU reference), align (every golden
# fixture, f32 and bf16), align-pool (bf16 on tests/fixtures/bf16-pool, both of
# its reference runs, teacher-forced; the two steps' JSON reports come packed in
# $OUT/<step>-reports.tar.xz), bench (the 8-layer BerryLM-OS-shaped benchmark),
# paged (paged vs contiguous KV), paged-prefix (prompts after a prefix-cache
# hit under paged KV against the contiguous cache, bit for bit), invariance-paged / invariance-contiguous (the
# serving invariance tests with paged attention on / off), template (chat
# template and grammar-pinned tool calls), e2e (batch-1 decode end to end through
# `mistralrs serve` on an 8-layer BerryLM-OS-shaped random bf16 checkpoint, next to
# the bench's model forward: tools/e2e_decode.py; about 6 minutes at most),
# scale-bench (the 40-layer BerryLM-OS-shaped model's forward: prefill
# $SCALE_PREFILL, default 4096,16384, and decode at batch 1, 64 and 256; writes
# the 40-layer checkpoint first, once per machine), scale-serve (that checkpoint
# through `mistralrs serve`: tools/load_test.py's sweep at concurrency
# $SCALE_CONCURRENCY, default 1,64,256, each cell after $SCALE_WARMUP_ROUNDS (default 1)
# uncounted rounds, then batch-1 decode end to end),
# scale-isq (that checkpoint served unquantized and with each ISQ type of
# $SCALE_ISQ at once: load time, memory, batch-1 decode end to end alternated
# between them, the sweep at concurrency 64 unless $SCALE_ISQ_SWEEP is 0),
# scale-align-isq (that checkpoint quantized to each type of $SCALE_ISQ,
# teacher-forced against the unquantized bf16 model over 3000 positions), isq (the ISQ and UQFF
# serving tests on the GPU), options (the host's options on the GPU: --no-kv-cache,
# the refused imatrix, calibration and device map), lora (a LoRA adapter against
# its merged checkpoint), reload (the model unloaded and reloaded), sampling (the sampling
# parameters, stop sequences and seeds against the reference, with paged attention), scale-ttft (the time to first token of single
# prompts of 4k to 128k tokens on that checkpoint), scale-prefix (the same
# for prompts after a prefix-cache hit: a shared 16k-token prefix, then 4k or
# 16k new tokens; the scale steps' servers take $SCALE_SERVER_ARGS too), scale-interference (16
# streams on that checkpoint while a
# $SCALE_LONG_PROMPT-token prompt, default 32768, prefills), scale-soak (the
# load tool's soak on that checkpoint: $SOAK_CLIENTS clients, default 256, for
# $SOAK_MINUTES whole minutes, default 8, 10 % hang-ups, $SOAK_INVALID of invalid requests,
# default 0), model-errors (model errors through the server with paged
# attention: a NaN checkpoint and a tokenizer beyond the embedding table, then
# a failed forward step and a sticky device error injected under the driver by
# tools/cuda_fault_shim.c, which it compiles with cc), fla
# (fla's chunk_kda and fused_recurrent_kda at BerryLM-OS shapes, issue #6's
# comparison: tools/fla_bench.py, $OUT/fla.json; needs python3 with torch and
# triton, and the wheels of fla-core and of the pure-Python packages it imports,
# einops and packaging, in $FLA_WHEELS (default .gpu3, e.g. `pip download
# fla-core==0.6.0 einops packaging --no-deps -d .gpu3` on a machine with PyPI);
# they are unzipped once per machine to $FLA_DIR; $FLA_ARGS are passed on),
# ab-decode (two builds' decode forward alternated: the base build's
# berrylm-bench in $BASE_PACKED against this one's, $AB_ROUNDS rounds, default
# 6, of $AB_LAYERS layers, default 40, at batch $AB_BATCH, default 1).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-$PWD/.device-bin}"
PACKED="${PACKED:-.device}"
# Unpacks the zstd- or xz-compressed executables of folder $1 into folder $2
# (a zstd binary may come beside them where the machine has none); one
# already there is kept.
unpack() {
    local folder="$1" bin="$2" packed name zstd
    zstd="$(command -v zstd || echo "$folder/zstd")"
    mkdir -p "$bin"
    for packed in "$folder"/*.zst "$folder"/*.xz; do
        [ -e "$packed" ] || continue
        name="$(basename "${packed%.*}")"
        [ -x "$bin/$name" ] && continue
        case "$packed" in
        *.zst) "$zstd" -q -dc "$packed" > "$bin/$name" ;;
        *.xz) xz -dc "$packed" > "$bin/$name" ;;
        esac && chmod +x "$bin/$name"
    done
}
unpack "$PACKED" "$BIN"
# The fla step's python3 keeps the caller's library path (torch brings its own CUDA libraries).
PY_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="${CUDA_RUNTIME_LIBS:-/usr/local/cuda-13.0/targets/x86_64-linux/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BERRYLM_HOST_BIN="$BIN/mistralrs" BERRYLM_FIXTURES="$PWD/tests/fixtures"
FIXTURES="tiny-hf small-hybrid small-hybrid-alt-layout small-hybrid-bf16 variant-a variant-b no-attnres trained-tiny"
BF16_POOL="tiny-hf small-hybrid small-hybrid-bf16 variant-a variant-b no-attnres"
status=0
FLA_WHEELS="${FLA_WHEELS:-.gpu3}" FLA_DIR="${FLA_DIR:-/tmp/berrylm-fla}"
E2E_CHECKPOINT="${E2E_CHECKPOINT:-/tmp/berrylm-os-8l}" E2E_PORT="${E2E_PORT:-18500}"

# Starts `mistralrs serve` on checkpoint $1 at port $2 with the further
# arguments, logging to $OUT/$(basename $1)-server.log, and waits until it
# answers /v1/models ($READY_TIMEOUT_S seconds at most, default 300). Sets
# `server` to its pid.
start_server() {
    local checkpoint="$1" port="$2"
    shift 2
    server_log="${OUT:-/tmp}/$(basename "$checkpoint")-server.log"
    "$BIN/mistralrs" serve -m "$checkpoint" --port "$port" "$@" > "$server_log" 2>&1 &
    server=$!
    python3 - "http://127.0.0.1:$port/v1/models" "$server" "${READY_TIMEOUT_S:-300}" <<'PY'
import os, sys, time, urllib.request
deadline = time.time() + float(sys.argv[3])
while time.time() < deadline:
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        sys.exit("the server exited before it was ready")
    try:
        urllib.request.urlopen(sys.argv[1], timeout=5).read()
        sys.exit(0)
    except OSError:
        time.sleep(2)
sys.exit(f"the server was not ready within {sys.argv[3]} s")
PY
}

# Stops the servers whose pids are given: SIGTERM starts their graceful
# shutdown (the requests in flight are answered first); one still running a
# minute later gets a second signal, which ends it at once.
stop_servers() {
    kill "$@" 2>/dev/null
    for _ in $(seq 60); do
        kill -0 "$@" 2>/dev/null || break
        sleep 1
    done
    kill -INT "$@" 2>/dev/null
    wait "$@" 2>/dev/null
}

stop_server() {
    stop_servers "$server"
    echo "--- server log (tail)"
    tail -n 30 "$server_log"
}

# The 40-layer BerryLM-OS-shaped checkpoint (36.6 GB; about 90 s to write),
# once per machine.
SCALE_CHECKPOINT="${SCALE_CHECKPOINT:-/tmp/berrylm-os-40l}" SCALE_PORT="${SCALE_PORT:-18600}"
scale_checkpoint() {
    [ -f "$SCALE_CHECKPOINT/config.json" ] && return 0
    timeout 400 "$BIN/berrylm-bench" --device cuda --layers 40 \
        --save-checkpoint "$SCALE_CHECKPOINT" || { rm -rf "$SCALE_CHECKPOINT"; return 1; }
}

# The scale-serve step: the 40-layer checkpoint through `mistralrs serve`
# (paged attention, 256 sequences at most): the load tool's sweep over
# concurrency $SCALE_CONCURRENCY of 128-token prompts and 128 output tokens,
# each cell after $SCALE_WARMUP_ROUNDS uncounted rounds of its concurrency
# (default 1; 0 measures the cold server's first batches too), then batch-1 decode end to end next to the forward of the scale-bench step
# ($OUT/bench-40l.json, when present).
scale_serve() {
    local code forward=""
    scale_checkpoint || return 1
    if [ -n "${OUT:-}" ] && [ -f "$OUT/bench-40l.json" ]; then
        forward="$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["decode"]; print(next(r["ms_per_step"] for r in d if r["batch"] == 1))' \
            "$OUT/bench-40l.json")"
    fi
    start_server "$SCALE_CHECKPOINT" "$SCALE_PORT" --dtype bf16 --max-seqs 256 --pa-memory-mb 16384
    code=$?
    if [ "$code" -eq 0 ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader | sed "s/^/bf16: device memory in use /"
        timeout 420 python3 tools/load_test.py sweep --url "http://127.0.0.1:$SCALE_PORT" \
            --concurrency "${SCALE_CONCURRENCY:-1,64,256}" --prompt-tokens 128 --output-tokens 128 \
            --warmup-rounds "${SCALE_WARMUP_ROUNDS:-1}" \
            ${OUT:+--json "$OUT/sweep-40l.json"}
        code=$?
        timeout 120 python3 tools/e2e_decode.py --url "http://127.0.0.1:$SCALE_PORT" \
            --prompt-tokens 32 --max-tokens 65 --repeats 3 --warmup 1 \
            ${forward:+--compare-forward-ms "$forward"} ${OUT:+--json "$OUT/e2e-40l.json"} || code=1
    fi
    stop_server
    return "$code"
}

# The scale-isq step: the 40-layer checkpoint served unquantized and with
# each ISQ type of $SCALE_ISQ (default "q4k q8_0") at once, one server per
# model on ports $SCALE_PORT, +1, ... (paged attention, 4 GiB KV pools, 64
# sequences): each one's load time (started together, start to ready), the
# plugin's line of the weights' bytes and device memory; batch-1 decode end to
# end in $SCALE_ISQ_ROUNDS rounds (default 3), each round visiting every server
# in turn, so that the host CPU's speed, which drifts over tens of seconds,
# weighs on every model alike; then each one's concurrency-64 sweep (128-token
# prompts, 128 output tokens, 2 requests per client), one at a time.
scale_isq() {
    local isq code=0 ready=0 port round pids=() names=() starts=() ready_s=()
    scale_checkpoint || return 1
    names=(none ${SCALE_ISQ:-q4k q8_0})
    for i in "${!names[@]}"; do
        isq="${names[$i]}"
        starts[$i]=$(date +%s)
        "$BIN/mistralrs" serve -m "$SCALE_CHECKPOINT" --port $((SCALE_PORT + i)) --dtype bf16 \
            --max-seqs 64 --pa-memory-mb 4096 $([ "$isq" = none ] || echo --isq "$isq") \
            > "${OUT:-/tmp}/server-40l-$isq.log" 2>&1 &
        pids[$i]=$!
        ready_s[$i]=""
    done
    for _ in $(seq 540); do
        for i in "${!names[@]}"; do
            [ -n "${ready_s[$i]}" ] && continue
            if curl -sf "http://127.0.0.1:$((SCALE_PORT + i))/v1/models" > /dev/null; then
                ready_s[$i]=$(($(date +%s) - starts[i]))
                ready=$((ready + 1))
            fi
        done
        [ "$ready" -eq "${#names[@]}" ] && break
        sleep 1
    done
    for i in "${!names[@]}"; do
        echo "${names[$i]}: ready ${ready_s[$i]:-never} s after start (pid ${pids[$i]})"
        grep -h "in-situ quantization quantized" "${OUT:-/tmp}/server-40l-${names[$i]}.log"
    done
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    if [ "$ready" -ne "${#names[@]}" ]; then
        stop_servers "${pids[@]}"
        return 1
    fi
    for round in $(seq "${SCALE_ISQ_ROUNDS:-3}"); do
        for i in "${!names[@]}"; do
            timeout 120 python3 tools/e2e_decode.py --url "http://127.0.0.1:$((SCALE_PORT + i))" \
                --prompt-tokens 32 --max-tokens 65 --repeats 3 --warmup 1 \
                ${OUT:+--json "$OUT/e2e-40l-${names[$i]}-$round.json"} 2>&1 |
                grep "decode:" | sed "s/^/round $round ${names[$i]}/" || code=1
        done
    done
    if [ "${SCALE_ISQ_SWEEP:-1}" = 1 ]; then
        for i in "${!names[@]}"; do
            port=$((SCALE_PORT + i))
            timeout 240 python3 tools/load_test.py sweep --url "http://127.0.0.1:$port" \
                --concurrency 64 --prompt-tokens 128 --output-tokens 128 --requests-per-client 2 \
                ${OUT:+--json "$OUT/sweep-40l-${names[$i]}.json"} 2>&1 |
                grep -E "^\| 64" | sed "s/^/${names[$i]} /" || code=1
        done
    fi
    stop_servers "${pids[@]}"
    return "$code"
}

# The scale-align-isq step: the 40-layer checkpoint quantized to each type of
# $SCALE_ISQ against the unquantized bf16 model, teacher-forced on
# $SCALE_ALIGN_SEQUENCES (default 3) sequences of $SCALE_ALIGN_TOKENS
# (default 1000) seeded random ids (tools/token_golden.py): the bf16 run
# writes its own golden file first, once per machine and token count (its
# comparison with the token file's placeholder logits is not read), then
# each quantized run is compared with it.
scale_align_isq() {
    local tokens=/tmp/berrylm-os-40l-tokens.safetensors
    local sequences="${SCALE_ALIGN_SEQUENCES:-3}" tokens_per_sequence="${SCALE_ALIGN_TOKENS:-1000}"
    local golden isq code=0 vocab
    golden="/tmp/berrylm-os-40l-bf16-golden-${sequences}x${tokens_per_sequence}.safetensors"
    scale_checkpoint || return 1
    vocab="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
        "$SCALE_CHECKPOINT/config.json")" || return 1
    python3 tools/token_golden.py --out "$tokens" --vocab "$vocab" \
        --sequences "$sequences" --tokens "$tokens_per_sequence" || return 1
    if [ ! -f "$golden" ]; then
        "$BIN/berrylm-align" --model "$SCALE_CHECKPOINT" --golden "$tokens" --dtype bf16 \
            --device cuda --teacher-forced-only --write-golden "$golden.partial" > /dev/null
        mv "$golden.partial" "$golden" || return 1
    fi
    for isq in ${SCALE_ISQ:-q4k q8_0}; do
        "$BIN/berrylm-align" --model "$SCALE_CHECKPOINT" --golden "$golden" --dtype bf16 \
            --device cuda --isq "$isq" --teacher-forced-only \
            ${OUT:+--json "$OUT/align-40l-$isq.json"} > "/tmp/berrylm-align-40l-$isq.txt" || code=1
        head -n 9 "/tmp/berrylm-align-40l-$isq.txt"
    done
    return "$code"
}

# Serves the 40-layer checkpoint (paged attention, a 16 GiB KV pool, at most
# $1 sequences, $SCALE_SERVER_ARGS added, e.g. "--pa-cache-type f8e4m3") and
# runs the rest of the arguments, a command, against it.
with_scale_server() {
    local max_seqs="$1" code
    shift
    scale_checkpoint || return 1
    # shellcheck disable=SC2086 # $SCALE_SERVER_ARGS is a list of arguments
    start_server "$SCALE_CHECKPOINT" "$SCALE_PORT" --dtype bf16 --max-seqs "$max_seqs" --pa-memory-mb 16384 \
        ${SCALE_SERVER_ARGS:-}
    code=$?
    if [ "$code" -eq 0 ]; then
        "$@"
        code=$?
    fi
    stop_server
    return "$code"
}

# The scale-ttft step: the time to first token of single prompts of
# $SCALE_TTFT_PROMPTS tokens (default 4096,16384,32768,131072) on the 40-layer
# checkpoint (paged attention, a 16 GiB KV pool), one request at a time: a
# probe of each length first (it warms that length up), then 2 streamed
# requests per length with 2 output tokens; each prompt is new to the prefix
# cache. Compare with the bench's prefill of the same lengths in the same call.
ttft_clients() {
    timeout 400 python3 tools/load_test.py sweep --url "http://127.0.0.1:$SCALE_PORT" \
        --concurrency 1 --prompt-tokens "${SCALE_TTFT_PROMPTS:-4096,16384,32768,131072}" \
        --output-tokens 2 --requests-per-client 2 ${OUT:+--json "$OUT/ttft-40l.json"}
}

# The scale-prefix step: the time to first token of single prompts of
# $SCALE_PREFIX_PROMPTS tokens (default 20480,32768) that begin with the same
# $SCALE_PREFIX_SHARED tokens (default 16384) on the 40-layer checkpoint: after
# the first, each prompt's shared tokens come from the prefix cache and only
# the rest prefill (4096 and 16384 new tokens by default). Compare with
# scale-ttft's cold prompts of the same lengths.
prefix_clients() {
    timeout 400 python3 tools/load_test.py sweep --url "http://127.0.0.1:$SCALE_PORT" \
        --concurrency 1 --prompt-tokens "${SCALE_PREFIX_PROMPTS:-20480,32768}" \
        --shared-prefix-tokens "${SCALE_PREFIX_SHARED:-16384}" \
        --output-tokens 2 --requests-per-client 2 ${OUT:+--json "$OUT/prefix-40l.json"}
}

# The scale-interference step: 16 streams decode on the 40-layer checkpoint
# while one $SCALE_LONG_PROMPT-token prompt (default 32768) prefills; the load
# tool reports their inter-token latency before, during and after it.
interference_clients() {
    timeout 480 python3 tools/load_test.py interference --url "http://127.0.0.1:$SCALE_PORT" \
        --clients "${SCALE_CLIENTS:-16}" --long-prompt-tokens "${SCALE_LONG_PROMPT:-32768}" \
        ${OUT:+--json "$OUT/interference-40l.json"}
}

# The scale-soak step: the load tool's soak on the 40-layer checkpoint (256
# sequences at most): streamed completions of log-uniform prompts of 16 to
# 16384 tokens, 10 % of the clients hanging up mid-stream, with the server's
# /metrics and VmRSS sampled every 5 s.
soak_clients() {
    timeout $((${SOAK_MINUTES:-8} * 60 + 240)) python3 tools/load_test.py soak \
        --url "http://127.0.0.1:$SCALE_PORT" --plain-endpoint completions \
        --clients "${SOAK_CLIENTS:-256}" --minutes "${SOAK_MINUTES:-8}" \
        --max-prompt-tokens 16384 --output-tokens 128 --hangup-fraction 0.1 \
        --tools-fraction 0 --reasoning-fraction 0 --continue-fraction 0 \
        --invalid-fraction "${SOAK_INVALID:-0}" --metrics-interval 5 --server-pid "$server" \
        ${OUT:+--json "$OUT/soak-$(basename "$SCALE_CHECKPOINT")${SOAK_INVALID:+-invalid}.json"}
}

# The e2e step: writes the checkpoint (once per machine), measures the model
# forward at batch 1 with the bench, serves the checkpoint (paged attention, the
# CUDA default, with an 8 GiB KV pool) and measures decode through HTTP.
e2e() {
    local url="http://127.0.0.1:$E2E_PORT" forward="" server code
    if [ ! -f "$E2E_CHECKPOINT/model.safetensors" ]; then
        timeout 240 "$BIN/berrylm-bench" --device cuda --layers 8 \
            --save-checkpoint "$E2E_CHECKPOINT" || { rm -rf "$E2E_CHECKPOINT"; return 1; }
    fi
    if timeout 150 "$BIN/berrylm-bench" --device cuda --dtype bf16 --layers 8 --prefill none \
        --decode 1 --context 32 --no-kernels --json /tmp/berrylm-e2e-forward.json; then
        forward="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["decode"][0]["ms_per_step"])' \
            /tmp/berrylm-e2e-forward.json)"
    fi
    start_server "$E2E_CHECKPOINT" "$E2E_PORT" --dtype bf16 --pa-memory-mb 8192
    code=$?
    if [ "$code" -eq 0 ]; then
        timeout 240 python3 tools/e2e_decode.py --url "$url" --prompt-tokens 32 --max-tokens 129 \
            --repeats 5 --warmup 2 ${forward:+--compare-forward-ms "$forward"} \
            ${OUT:+--json "$OUT/e2e.json"}
        code=$?
    fi
    stop_server
    return "$code"
}

# The fla step: unzips every wheel in $FLA_WHEELS into its own folder under
# $FLA_DIR (once; Triton compiles from the source files, so no zip imports),
# puts those folders on PYTHONPATH and runs tools/fla_bench.py.
fla_bench() {
    local wheel dir path="" found=0
    mkdir -p "$FLA_DIR" || return 1
    for wheel in "$FLA_WHEELS"/*.whl; do
        [ -e "$wheel" ] || continue
        found=1
        dir="$FLA_DIR/$(basename "${wheel%.whl}")"
        if [ ! -e "$dir/.unpacked" ]; then
            rm -rf "$dir" "$dir.tmp"
            python3 -m zipfile -e "$wheel" "$dir.tmp" && touch "$dir.tmp/.unpacked" \
                && mv "$dir.tmp" "$dir" || { echo "cannot unzip $wheel" >&2; return 1; }
        fi
        path="${path:+$path:}$dir"
    done
    if [ "$found" -eq 0 ]; then
        echo "no wheels in $FLA_WHEELS (expected fla-core, einops and packaging *.whl)" >&2
        return 1
    fi
    echo "PYTHONPATH += $path"
    # shellcheck disable=SC2086 # FLA_ARGS is a list of arguments
    PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="$PY_LD_LIBRARY_PATH" \
        timeout 540 python3 tools/fla_bench.py \
        ${FLA_ARGS:-} ${OUT:+--json "$OUT/fla.json"}
}

# Two builds' decode forward alternated: the berrylm-bench of $BASE_PACKED
# (unpacked into $BASE_BIN, default .device-bin-base) then this build's,
# $AB_ROUNDS times (default 6), $AB_LAYERS layers (default 40) at batch
# $AB_BATCH (default 1), 100 steps from CUDA graphs a run; prints each run's
# decode row and weight-read floor.
ab_decode() {
    local base_bin="${BASE_BIN:-$PWD/.device-bin-base}" batch="${AB_BATCH:-1}" round bin
    unpack "${BASE_PACKED:?set BASE_PACKED to a folder with the base build of berrylm-bench}" "$base_bin"
    for round in $(seq "${AB_ROUNDS:-6}"); do
        for bin in "$base_bin" "$BIN"; do
            echo "round $round: $bin/berrylm-bench"
            "$bin/berrylm-bench" --device cuda --dtype bf16 --layers "${AB_LAYERS:-40}" --prefill none \
                --decode "$batch" --decode-kv graphs --no-kernels --no-op-costs --copy-mib 256 \
                --steps 100 --warmup 5 | grep -E "^\| $batch \||^floor at" || return 1
        done
    done
}

log() { if [ -n "${OUT:-}" ]; then tee -a "$OUT/$1.log"; else cat; fi; }

# The JSON reports of a step (folder $1) as one file, $OUT/$2-reports.tar.xz
# (a call brings back a few files of $OUT, not one per report); the folder is
# removed either way.
pack_reports() {
    [ -n "${OUT:-}" ] && tar -C "$1" -cJf "$OUT/$2-reports.tar.xz" .
    rm -rf "$1"
}

step() {
    case "$1" in
    kernels) "$BIN/test-cuda" --test-threads 1 ;;
    align)
        local reports failed=0
        reports="$(mktemp -d)"
        for dtype in f32 bf16; do
            for f in $FIXTURES; do
                "$BIN/berrylm-align" --model "tests/fixtures/$f/model" \
                    --golden "tests/fixtures/$f/golden.safetensors" \
                    --dtype "$dtype" --device cuda --json "$reports/$f-$dtype.json" || failed=1
            done
        done
        pack_reports "$reports" align
        return "$failed" ;;
    bench) "$BIN/berrylm-bench" --device cuda --dtype bf16 --layers 8 \
        --prefill 512,4096,16384 --decode 1,8,64 ${OUT:+--json "$OUT/bench.json"} ;;
    paged) "$BIN/test-server_paged" --ignored --test-threads 1 ;;
    paged-prefix) "$BIN/test-paged_prefix" --ignored --test-threads 1 ;;
    invariance-paged) BERRYLM_SERVER_ARGS="--paged-attn on --pa-memory-mb 1024" \
        "$BIN/test-server_invariance" --test-threads 1 ;;
    invariance-contiguous) BERRYLM_SERVER_ARGS="--paged-attn off" \
        "$BIN/test-server_invariance" --test-threads 1 ;;
    isq) "$BIN/test-server_isq" --test-threads 1 ;;
    options) "$BIN/test-server_options" --include-ignored --test-threads 1 ;;
    lora) "$BIN/test-server_lora" --test-threads 1 ;;
    reload) "$BIN/test-server_lifecycle" --test-threads 1 unloaded_and_reloaded ;;
    sampling) BERRYLM_SERVER_ARGS="--paged-attn on --pa-memory-mb 1024" \
        "$BIN/test-server_sampling" --test-threads 1 ;;
    align-pool)
        local reports failed=0
        reports="$(mktemp -d)"
        for run in from-pretrained cast-buffers; do
            mkdir -p "$reports/$run"
            for f in $BF16_POOL; do
                "$BIN/berrylm-align" --model "tests/fixtures/$f/model" \
                    --golden "tests/fixtures/bf16-pool/$run/$f/golden.safetensors" --dtype bf16 \
                    --device cuda --teacher-forced-only --json "$reports/$run/$f-bf16.json" || failed=1
            done
        done
        pack_reports "$reports" align-pool
        return "$failed" ;;
    scale-align-isq) scale_align_isq ;;
    template) BERRYLM_SERVER_ARGS="--paged-attn on --pa-memory-mb 1024" \
        "$BIN/test-server_chat_template" --test-threads 1 ;;
    e2e) e2e ;;
    scale-bench) scale_checkpoint && "$BIN/berrylm-bench" --device cuda --dtype bf16 --layers 40 \
        --prefill "${SCALE_PREFILL:-4096,16384}" --decode 1,64,256 --no-kernels \
        ${OUT:+--json "$OUT/bench-40l.json"} ;;
    scale-serve) scale_serve ;;
    scale-isq) scale_isq ;;
    scale-interference) with_scale_server 64 interference_clients ;;
    scale-ttft) with_scale_server 1 ttft_clients ;;
    scale-prefix) with_scale_server 1 prefix_clients ;;
    scale-soak) with_scale_server 256 soak_clients ;;
    model-errors) cc -O2 -shared -fPIC -o "$BIN/libcuda_fault_shim.so" tools/cuda_fault_shim.c -ldl &&
        BERRYLM_CUDA_FAULT_SHIM="$BIN/libcuda_fault_shim.so" \
        BERRYLM_SERVER_ARGS="--paged-attn on --pa-memory-mb 1024" \
        "$BIN/test-server_model_errors" --include-ignored --test-threads 1 ;;
    fla) fla_bench ;;
    ab-decode) ab_decode ;;
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
