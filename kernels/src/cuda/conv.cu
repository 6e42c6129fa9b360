// Depthwise causal short convolution + SiLU with a carried state of K columns
// (spec 3.6 step 4 and section 4).
//
// With xs[b, c, :] = concat(state[b, c, 0..K], x[b, 0..T, c]) ("history"),
//   pre[b, t, c] = sum_{j<K} w[c, j] * xs[b, c, t + j + 1]     (f32, j ascending)
//   out[b, t, c] = round_x(silu(round_x(pre)))
//   new_state[b, c, i] = round_state(xs[b, c, T + i]),  i < K.
// The sum is evaluated as the CPU reference does (separately rounded products
// and sums from 0, no FMA contraction), so `pre` matches it bit for bit.
//
// One thread per (b, c, chunk of CHUNK time steps); threads of a block span
// consecutive channels so that every x/out access is coalesced. The thread of
// the last chunk writes the new state.
#include "common.cuh"

namespace berrylm::conv {

constexpr int kThreads = 128;
constexpr int kChunk = 64;

template <typename TX, typename TS>
struct History {
    const TX* x;
    const TS* state;
    long long x_base;      // index of x[b, 0, c]
    long long state_base;  // index of state[b, c, 0]
    int channels;
    int kernel_size;
    __device__ __forceinline__ float operator()(int i) const {
        return i < kernel_size
                   ? berrylm::to_f32(state[state_base + i])
                   : berrylm::to_f32(x[x_base + static_cast<long long>(i - kernel_size) * channels]);
    }
};

// KC > 0: kernel size known at compile time (sliding window in registers).
// KC == 0: any kernel size, history read from memory.
template <typename TX, typename TS, int KC>
__global__ void __launch_bounds__(kThreads)
    causal_conv1d_kernel(const TX* __restrict__ x, const float* __restrict__ weight,
                         const TS* __restrict__ state, TX* __restrict__ out,
                         TS* __restrict__ new_state, int seq_len, int channels, int kernel_size) {
    const int c = blockIdx.x * kThreads + threadIdx.x;
    if (c >= channels) return;
    const int b = blockIdx.z;
    const int t0 = blockIdx.y * kChunk;
    const int t1 = min(seq_len, t0 + kChunk);
    const int k = KC > 0 ? KC : kernel_size;
    History<TX, TS> history{x,
                            state,
                            static_cast<long long>(b) * seq_len * channels + c,
                            (static_cast<long long>(b) * channels + c) * k,
                            channels,
                            k};
    const float* taps = weight + static_cast<long long>(c) * k;
    TX* out_bc = out + static_cast<long long>(b) * seq_len * channels + c;

    if constexpr (KC > 0) {
        float w[KC];
        float window[KC];  // window[j] = history(t + j + 1) while computing step t
#pragma unroll
        for (int j = 0; j < KC; ++j) w[j] = taps[j];
#pragma unroll
        for (int j = 0; j + 1 < KC; ++j) window[j] = history(t0 + j + 1);
        for (int t = t0; t < t1; ++t) {
            window[KC - 1] = berrylm::to_f32(x[history.x_base + static_cast<long long>(t) * channels]);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < KC; ++j) sum = __fadd_rn(sum, __fmul_rn(w[j], window[j]));
            out_bc[static_cast<long long>(t) * channels] =
                berrylm::from_f32<TX>(berrylm::silu(berrylm::round_to<TX>(sum)));
#pragma unroll
            for (int j = 0; j + 1 < KC; ++j) window[j] = window[j + 1];
        }
    } else {
        for (int t = t0; t < t1; ++t) {
            float sum = 0.0f;
            for (int j = 0; j < k; ++j) sum = __fadd_rn(sum, __fmul_rn(taps[j], history(t + j + 1)));
            out_bc[static_cast<long long>(t) * channels] =
                berrylm::from_f32<TX>(berrylm::silu(berrylm::round_to<TX>(sum)));
        }
    }

    if (blockIdx.y == gridDim.y - 1) {
        TS* dst = new_state + history.state_base;
        for (int i = 0; i < k; ++i) dst[i] = berrylm::from_f32<TS>(history(seq_len + i));
    }
}

template <typename TX, typename TS>
int launch(const void* x, const float* weight, const void* state, void* out, void* new_state,
           int batch, int seq_len, int channels, int kernel_size, cudaStream_t stream) {
    const int chunks = seq_len > 0 ? (seq_len + kChunk - 1) / kChunk : 1;
    const dim3 grid((channels + kThreads - 1) / kThreads, chunks, batch);
    const TX* xp = static_cast<const TX*>(x);
    const TS* sp = static_cast<const TS*>(state);
    TX* op = static_cast<TX*>(out);
    TS* np = static_cast<TS*>(new_state);
    switch (kernel_size) {
        case 2:
            causal_conv1d_kernel<TX, TS, 2><<<grid, kThreads, 0, stream>>>(
                xp, weight, sp, op, np, seq_len, channels, kernel_size);
            break;
        case 3:
            causal_conv1d_kernel<TX, TS, 3><<<grid, kThreads, 0, stream>>>(
                xp, weight, sp, op, np, seq_len, channels, kernel_size);
            break;
        case 4:
            causal_conv1d_kernel<TX, TS, 4><<<grid, kThreads, 0, stream>>>(
                xp, weight, sp, op, np, seq_len, channels, kernel_size);
            break;
        default:
            causal_conv1d_kernel<TX, TS, 0><<<grid, kThreads, 0, stream>>>(
                xp, weight, sp, op, np, seq_len, channels, kernel_size);
            break;
    }
    return berrylm::launch_status();
}

}  // namespace berrylm::conv

using namespace berrylm::conv;

extern "C" int berrylm_causal_conv1d(int x_dtype, int state_dtype, const void* x,
                                     const float* weight, const void* state, void* out,
                                     void* new_state, int batch, int seq_len, int channels,
                                     int kernel_size, void* stream) {
    if (batch == 0 || channels == 0 || kernel_size <= 0) return 0;
    if (batch > 65535) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(x_dtype, TX, {
        BERRYLM_DISPATCH_DTYPE(state_dtype, TS, {
            return launch<TX, TS>(x, weight, state, out, new_state, batch, seq_len, channels,
                                  kernel_size, s);
        });
    });
    return 0;
}
