// The elementwise tails of the MoE block (spec 3.7), with the reference's
// rounding points (round_x: to the activation dtype, RNE):
//
// SwiGLU of a packed gate | up row of width 2I:
//   y[n, i] = round_x(round_x(silu(gate[n, i])) * up[n, i])
//
// The gated shared expert added to the routed output and the residual
// (berrylm::moe_residual).
//
// Grid-stride loops, one element per thread and step.
#include "common.cuh"

namespace berrylm::mlp {

template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ gate_up, long long gate_up_stride,
                              T* __restrict__ out, long long total, int intermediate) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += stride) {
        const long long row = i / intermediate;
        const long long gate_index = row * gate_up_stride + (i - row * intermediate);
        const float activated = berrylm::round_to<T>(berrylm::silu(berrylm::to_f32(gate_up[gate_index])));
        out[i] = berrylm::from_f32<T>(
            __fmul_rn(activated, berrylm::to_f32(gate_up[gate_index + intermediate])));
    }
}

template <typename T>
__global__ void add_moe_output_kernel(const T* __restrict__ residual, const T* __restrict__ routed,
                                      const T* __restrict__ shared,
                                      const T* __restrict__ gate_logit,
                                      long long gate_logit_stride, T* __restrict__ out,
                                      long long total, int hidden) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += stride) {
        out[i] = berrylm::moe_residual<T>(
            berrylm::to_f32(residual[i]), berrylm::to_f32(routed[i]), berrylm::to_f32(shared[i]),
            berrylm::to_f32(gate_logit[i / hidden * gate_logit_stride]));
    }
}

constexpr int kThreads = 256;

}  // namespace berrylm::mlp

using namespace berrylm::mlp;

// Row r of gate_up (its gate, then its up columns) starts `gate_up_stride`
// >= 2 * intermediate elements after row r - 1.
extern "C" int berrylm_swiglu(int dtype, const void* gate_up, long long gate_up_stride, void* out,
                              long long rows, int intermediate, void* stream) {
    const long long total = rows * intermediate;
    if (total == 0) return 0;
    if (gate_up_stride < 2ll * intermediate) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned int blocks = berrylm::elementwise_blocks(total, kThreads);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        swiglu_kernel<T><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(gate_up),
                                                     gate_up_stride, static_cast<T*>(out), total,
                                                     intermediate);
    });
    return berrylm::launch_status();
}

// The gate logit of row r is `gate_logit_stride` >= 1 elements after that of
// row r - 1.
extern "C" int berrylm_add_moe_output(int dtype, const void* residual, const void* routed,
                                      const void* shared, const void* gate_logit,
                                      long long gate_logit_stride, void* out, long long rows,
                                      int hidden, void* stream) {
    const long long total = rows * hidden;
    if (total == 0) return 0;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned int blocks = berrylm::elementwise_blocks(total, kThreads);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        add_moe_output_kernel<T><<<blocks, kThreads, 0, s>>>(
            static_cast<const T*>(residual), static_cast<const T*>(routed),
            static_cast<const T*>(shared), static_cast<const T*>(gate_logit), gate_logit_stride,
            static_cast<T*>(out), total, hidden);
    });
    return berrylm::launch_status();
}
