# Source this file (`. kernels/cuda-env.sh`) to build `berrylm-kernels` with
# `--features cuda` on a machine WITHOUT a CUDA toolkit or GPU driver.
#
# It sets CUDA_HOME, PATH, LIBRARY_PATH, CPATH and CUDA_COMPUTE_CAP to a CUDA
# 13.0 toolkit installed from PyPI wheels in a virtual environment, and links
# against a stub `libcuda.so.1` (the driver is not on PyPI). The stub only
# satisfies the linker: binaries built this way run on a real GPU machine,
# where the dynamic loader finds the real driver's libcuda.so.1.
#
# Missing pieces (the venv, the symlinks, the stub) are created on first use.
# Variables you may set before sourcing:
#   BERRYLM_CUDA_VENV  the venv (default /work/cuda-venv)
#   BERRYLM_CUDA_STUBS the folder for symlinks and the stub (default $BERRYLM_CUDA_VENV/stubs)
#   CUDA_COMPUTE_CAP   target compute capability (default 90 -> sm_90a)
# See CUDA.md for the whole recipe.

BERRYLM_CUDA_VENV="${BERRYLM_CUDA_VENV:-/work/cuda-venv}"
BERRYLM_CUDA_STUBS="${BERRYLM_CUDA_STUBS:-$BERRYLM_CUDA_VENV/stubs}"

_berrylm_cuda_setup() {
    local venv="$BERRYLM_CUDA_VENV" stubs="$BERRYLM_CUDA_STUBS"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || return 1
    fi
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    local cu="$site/nvidia/cu13"
    if [ ! -x "$cu/bin/nvcc" ] || [ ! -e "$cu/lib/libcublasLt.so.13" ]; then
        "$venv/bin/pip" install -q \
            nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
            nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 \
            nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 \
            || return 1
    fi
    mkdir -p "$stubs" || return 1
    # Unversioned names for `-lcudart -lcublas ...` (the wheels ship only .so.N).
    local lib
    for lib in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
        ln -sf "$cu/lib/lib$lib" "$stubs/lib${lib%.so.*}.so"
    done
    # The stub driver: every `cu*` function that cudarc's driver bindings can
    # reference (a superset of `nm -u` on the cudarc/candle rlibs), as a dummy.
    if [ ! -e "$stubs/libcuda.so.1" ]; then
        local cudarc_src
        cudarc_src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1)"
        if [ -z "$cudarc_src" ]; then
            echo "cuda-env.sh: cudarc 0.19 sources not found; run 'cargo xtask prepare && cargo fetch' first, then source again" >&2
            return 1
        fi
        grep -ohE "^pub unsafe fn cu[A-Za-z0-9_]+\(" "$cudarc_src/src/driver/sys/mod.rs" \
            | sed -E 's/^pub unsafe fn ([A-Za-z0-9_]+)\(/\1/' | sort -u \
            | awk '{ printf "int %s(void) { return 999; /* CUDA_ERROR_UNKNOWN */ }\n", $1 }' \
            > "$stubs/libcuda_stub.c" || return 1
        cc -shared -fPIC -o "$stubs/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$stubs/libcuda_stub.c" \
            || return 1
    fi
    ln -sf libcuda.so.1 "$stubs/libcuda.so"
    export CUDA_HOME="$cu" CUDA_PATH="$cu"
    export PATH="$cu/bin:$PATH"
    export LIBRARY_PATH="$stubs:$cu/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
    export CPATH="$cu/include${CPATH:+:$CPATH}"
    # So that ld finds the libraries that libcublas.so.13 needs.
    export LD_LIBRARY_PATH="$cu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
    # candle-kernels compiles its PTX through cudaforge: one nvcc at a time.
    export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-1}"
}

# Sourcing returns the setup's status, so that `. kernels/cuda-env.sh && cargo
# xtask build --cuda` stops at a failed setup.
if _berrylm_cuda_setup; then
    unset -f _berrylm_cuda_setup
    echo "cuda-env.sh: CUDA_HOME=$CUDA_HOME CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
else
    unset -f _berrylm_cuda_setup
    echo "cuda-env.sh: setup failed" >&2
    false
fi
