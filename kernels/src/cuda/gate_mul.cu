// The output gate of the gated full attention (spec 3.5 step 5), with the
// reference's rounding points (round_x: to the dtype of x, RNE):
//
//   s = round_x(1 / (exp(-gate) + 1))      (f32, IEEE division)
//   y = round_x(x * s)
//
// x and y are contiguous [rows, width]; the gate's rows of `width` elements
// lie at `gate_row_stride` elements from one another, so that the gate half
// of the per-head interleaved q_proj output is read in place. Grid-stride
// loop, one element per thread and step.
#include "common.cuh"

namespace berrylm::gate_mul {

template <typename T>
__global__ void sigmoid_gate_mul_kernel(const T* __restrict__ x, const T* __restrict__ gate,
                                        long long gate_row_stride, T* __restrict__ out,
                                        long long total, int width) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += stride) {
        const long long row = i / width;
        const float g = berrylm::to_f32(gate[row * gate_row_stride + (i - row * width)]);
        const float s = berrylm::round_to<T>(__fdiv_rn(1.0f, __fadd_rn(expf(-g), 1.0f)));
        out[i] = berrylm::from_f32<T>(__fmul_rn(berrylm::to_f32(x[i]), s));
    }
}

constexpr int kThreads = 256;

}  // namespace berrylm::gate_mul

using namespace berrylm::gate_mul;

extern "C" int berrylm_sigmoid_gate_mul(int dtype, const void* x, const void* gate,
                                        long long gate_row_stride, void* out, long long rows,
                                        int width, void* stream) {
    const long long total = rows * width;
    if (total == 0) return 0;
    if (width < 0 || gate_row_stride < width) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned int blocks = berrylm::elementwise_blocks(total, kThreads);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        sigmoid_gate_mul_kernel<T><<<blocks, kThreads, 0, s>>>(
            static_cast<const T*>(x), static_cast<const T*>(gate), gate_row_stride,
            static_cast<T*>(out), total, width);
    });
    return berrylm::launch_status();
}
