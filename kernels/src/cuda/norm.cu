// Gated RMSNorm, norm before gate, SiLU (spec 3.1, BerryLMRMSNormGated):
//   n  = round_x(x / sqrt(mean(x^2) + eps))     (f32)
//   wn = round_x(weight * n)
//   y  = round_x(wn * silu(z))                  (z in f32)
// One warp per row; each lane strides over the row (coalesced).
#include "common.cuh"

namespace berrylm::norm {

constexpr int kWarpsPerBlock = 8;

template <typename TX, typename TZ>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gated_rms_norm_kernel(const TX* __restrict__ x, const TZ* __restrict__ z,
                          const float* __restrict__ weight, TX* __restrict__ out, long long rows,
                          int width, float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    if (row >= rows) return;
    const TX* xr = x + row * width;
    const TZ* zr = z + row * width;
    TX* yr = out + row * width;
    float sum_sq = 0.0f;
    for (int i = lane; i < width; i += 32) {
        const float v = berrylm::to_f32(xr[i]);
        sum_sq += v * v;
    }
    sum_sq = berrylm::warp_sum(sum_sq);
    const float mean_sq = __fdiv_rn(sum_sq, static_cast<float>(width));
    const float inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
    for (int i = lane; i < width; i += 32) {
        const float n = berrylm::round_to<TX>(__fmul_rn(berrylm::to_f32(xr[i]), inv_rms));
        const float wn = berrylm::round_to<TX>(__fmul_rn(weight[i], n));
        yr[i] = berrylm::from_f32<TX>(__fmul_rn(wn, berrylm::silu(berrylm::to_f32(zr[i]))));
    }
}

}  // namespace berrylm::norm

using namespace berrylm::norm;

// `z_dtype` must equal `x_dtype` or be f32.
extern "C" int berrylm_gated_rms_norm(int x_dtype, int z_dtype, const void* x, const void* z,
                                      const float* weight, void* out, long long rows, int width,
                                      float eps, void* stream) {
    if (rows == 0 || width == 0) return 0;
    if (z_dtype != x_dtype && z_dtype != berrylm::kF32) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const long long blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (blocks > 0x7fffffffll) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(x_dtype, TX, {
        if (z_dtype == x_dtype) {
            gated_rms_norm_kernel<TX, TX><<<static_cast<unsigned int>(blocks), kWarpsPerBlock * 32,
                                            0, s>>>(static_cast<const TX*>(x),
                                                    static_cast<const TX*>(z), weight,
                                                    static_cast<TX*>(out), rows, width, eps);
        } else {
            gated_rms_norm_kernel<TX, float><<<static_cast<unsigned int>(blocks),
                                               kWarpsPerBlock * 32, 0, s>>>(
                static_cast<const TX*>(x), static_cast<const float*>(z), weight,
                static_cast<TX*>(out), rows, width, eps);
        }
    });
    return berrylm::launch_status();
}
