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
// The output channels are split into up to kMaxGroups consecutive groups,
// each written to its own contiguous [B, T, width] buffer (the packed q|k|v
// of a KDA layer come out as three tensors).
//
// The state of sequence b is row r(b) of a state buffer [rows, C, K]:
// r(b) = b without slots (separate [B, C, K] state and new_state buffers),
// r(b) = slots[b] with them, for a pool from whose rows the states are read
// and into whose rows the new ones are written in place (new_state ==
// state). A slot >= rows makes its sequence a pad row (PAD_SLOT in the Rust
// API): it starts from a zero state and writes none. The Rust API validates
// the other slots on the host.
//
// One thread per (b, c, chunk of kChunk time steps); threads of a block span
// consecutive channels so that every x/out access is coalesced. The thread of
// the last chunk writes the new state.
//
// In place: the thread of chunk 0 reads the old state of (b, c), so with
// several chunks the thread of the last chunk, writing the new state, would
// race with it. A pool update of more than one chunk therefore runs two
// launches on one stream: the convolution without the state write, then
// `state_update_kernel` (one thread per (b, c)), which starts after the
// first launch has finished. With a single chunk, one thread owns (b, c): it
// reads every old column the outputs need before writing any, and writes
// the new columns in ascending order, column i from history(T + i) with
// T + i >= i, i.e. from an old column not yet overwritten; so the
// convolution kernel itself writes the new state in place (one launch,
// decode's case). Distinct slots give different sequences disjoint rows.
#include "common.cuh"

namespace berrylm::conv {

constexpr int kThreads = 128;
constexpr int kChunk = 64;
constexpr int kMaxGroups = 4;

// Where each group of output channels goes: channels start[g] ..
// start[g] + width[g] to out[g], `[B, T, width[g]]`.
struct OutputGroups {
    void* out[kMaxGroups];
    int start[kMaxGroups];
    int width[kMaxGroups];
    int count;
};

template <typename TX, typename TS>
struct History {
    const TX* x;
    const TS* state;       // null: a zero state (a pad row)
    long long x_base;      // index of x[b, 0, c]
    long long state_base;  // index of state[r(b), c, 0]
    long long x_stride;    // elements between consecutive time steps (rows) of x
    int kernel_size;
    // The history of channel c of sequence b, whose state is row `row` of
    // `state` ([rows, C, K]); zeros for row -1.
    __device__ __forceinline__ static History of(const TX* x, long long x_stride,
                                                 const TS* state, int b, int c, long long row,
                                                 int seq_len, int channels, int kernel_size) {
        return History{x,
                       row >= 0 ? state : nullptr,
                       static_cast<long long>(b) * seq_len * x_stride + c,
                       row >= 0 ? (row * channels + c) * kernel_size : 0,
                       x_stride,
                       kernel_size};
    }
    // The input at time step t of this channel.
    __device__ __forceinline__ float input(int t) const {
        return berrylm::to_f32(x[x_base + static_cast<long long>(t) * x_stride]);
    }
    __device__ __forceinline__ float operator()(int i) const {
        if (i >= kernel_size) return input(i - kernel_size);
        return state != nullptr ? berrylm::to_f32(state[state_base + i]) : 0.0f;
    }
};

// Where the carried states are read and the new ones written.
template <typename TS>
struct StateRows {
    const TS* state;        // [rows, C, K], read
    TS* new_state;          // [rows, C, K], or null (not written); may equal state
    const uint32_t* slots;  // [B], the row of each sequence; null: row b
    int rows;
};

// r(b), or -1 when slots[b] is out of range (a pad row).
template <typename TS>
__device__ __forceinline__ long long state_row(const StateRows<TS>& rows, int b) {
    if (rows.slots == nullptr) return b;
    const uint32_t slot = rows.slots[b];
    return slot < static_cast<uint32_t>(rows.rows) ? static_cast<long long>(slot) : -1;
}

// Writes the new state of (b, c), history(T + i) for i = 0 .. K-1 in
// ascending order (in place safe, see the header), to `dst`.
template <typename TX, typename TS>
__device__ __forceinline__ void write_new_state(const History<TX, TS>& history, TS* dst,
                                                int seq_len) {
    for (int i = 0; i < history.kernel_size; ++i) {
        dst[i] = berrylm::from_f32<TS>(history(seq_len + i));
    }
}

// KC > 0: kernel size known at compile time (sliding window in registers).
// KC == 0: any kernel size, history read from memory.
// `state` and `new_state` are not `__restrict__`: they may be one pool.
template <typename TX, typename TS, int KC>
__global__ void __launch_bounds__(kThreads)
    causal_conv1d_kernel(const TX* __restrict__ x, long long x_stride,
                         const float* __restrict__ weight, StateRows<TS> rows,
                         OutputGroups groups, int seq_len, int channels, int kernel_size) {
    const int c = blockIdx.x * kThreads + threadIdx.x;
    if (c >= channels) return;
    const int b = blockIdx.z;
    const long long row = state_row(rows, b);
    const int t0 = blockIdx.y * kChunk;
    const int t1 = min(seq_len, t0 + kChunk);
    const int k = KC > 0 ? KC : kernel_size;
    const auto history =
        History<TX, TS>::of(x, x_stride, rows.state, b, c, row, seq_len, channels, k);
    const float* taps = weight + static_cast<long long>(c) * k;
    int group = 0;
    while (group + 1 < groups.count && c >= groups.start[group + 1]) ++group;
    const int out_width = groups.width[group];
    TX* out_bc = static_cast<TX*>(groups.out[group]) +
                 static_cast<long long>(b) * seq_len * out_width + (c - groups.start[group]);

    if constexpr (KC > 0) {
        float w[KC];
        float window[KC];  // window[j] = history(t + j + 1) while computing step t
#pragma unroll
        for (int j = 0; j < KC; ++j) w[j] = taps[j];
#pragma unroll
        for (int j = 0; j + 1 < KC; ++j) window[j] = history(t0 + j + 1);
        for (int t = t0; t < t1; ++t) {
            window[KC - 1] = history.input(t);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < KC; ++j) sum = __fadd_rn(sum, __fmul_rn(w[j], window[j]));
            out_bc[static_cast<long long>(t) * out_width] =
                berrylm::from_f32<TX>(berrylm::silu(berrylm::round_to<TX>(sum)));
#pragma unroll
            for (int j = 0; j + 1 < KC; ++j) window[j] = window[j + 1];
        }
    } else {
        for (int t = t0; t < t1; ++t) {
            float sum = 0.0f;
            for (int j = 0; j < k; ++j) sum = __fadd_rn(sum, __fmul_rn(taps[j], history(t + j + 1)));
            out_bc[static_cast<long long>(t) * out_width] =
                berrylm::from_f32<TX>(berrylm::silu(berrylm::round_to<TX>(sum)));
        }
    }

    if (row >= 0 && rows.new_state != nullptr && blockIdx.y == gridDim.y - 1) {
        write_new_state(history, rows.new_state + history.state_base, seq_len);
    }
}

// The new states alone, after a convolution launch that wrote none (same
// stream): one thread per (b, c) writes row r(b) of `rows.new_state` from
// the old row in `rows.state` (the same pool) and x.
template <typename TX, typename TS>
__global__ void __launch_bounds__(kThreads)
    state_update_kernel(const TX* __restrict__ x, long long x_stride, StateRows<TS> rows,
                        int seq_len, int channels, int kernel_size) {
    const int c = blockIdx.x * kThreads + threadIdx.x;
    if (c >= channels) return;
    const int b = blockIdx.y;
    const long long row = state_row(rows, b);
    if (row < 0) return;
    const auto history =
        History<TX, TS>::of(x, x_stride, rows.state, b, c, row, seq_len, channels, kernel_size);
    write_new_state(history, rows.new_state + history.state_base, seq_len);
}

// Time chunks of the convolution grid (one for T = 0: the state is still
// written).
inline int chunk_count(int seq_len) { return seq_len > 0 ? (seq_len + kChunk - 1) / kChunk : 1; }

template <typename TX, typename TS>
int launch(const void* x, long long x_stride, const float* weight, const StateRows<TS>& rows,
           const OutputGroups& groups, int batch, int seq_len, int channels, int kernel_size,
           cudaStream_t stream) {
    const dim3 grid((channels + kThreads - 1) / kThreads, chunk_count(seq_len), batch);
    const TX* xp = static_cast<const TX*>(x);
    switch (kernel_size) {
        case 2:
            causal_conv1d_kernel<TX, TS, 2><<<grid, kThreads, 0, stream>>>(
                xp, x_stride, weight, rows, groups, seq_len, channels, kernel_size);
            break;
        case 3:
            causal_conv1d_kernel<TX, TS, 3><<<grid, kThreads, 0, stream>>>(
                xp, x_stride, weight, rows, groups, seq_len, channels, kernel_size);
            break;
        case 4:
            causal_conv1d_kernel<TX, TS, 4><<<grid, kThreads, 0, stream>>>(
                xp, x_stride, weight, rows, groups, seq_len, channels, kernel_size);
            break;
        default:
            causal_conv1d_kernel<TX, TS, 0><<<grid, kThreads, 0, stream>>>(
                xp, x_stride, weight, rows, groups, seq_len, channels, kernel_size);
            break;
    }
    return berrylm::launch_status();
}

// The in-place update of a pool (`rows.state == rows.new_state`, slots
// given): one launch for a single chunk, else the convolution without the
// state write followed by `state_update_kernel` (see the header).
template <typename TX, typename TS>
int launch_in_place(const void* x, long long x_stride, const float* weight,
                    const StateRows<TS>& rows, const OutputGroups& groups, int batch, int seq_len,
                    int channels, int kernel_size, cudaStream_t stream) {
    if (chunk_count(seq_len) == 1) {
        return launch<TX, TS>(x, x_stride, weight, rows, groups, batch, seq_len, channels,
                              kernel_size, stream);
    }
    StateRows<TS> read_only = rows;
    read_only.new_state = nullptr;
    const int status = launch<TX, TS>(x, x_stride, weight, read_only, groups, batch, seq_len,
                                      channels, kernel_size, stream);
    if (status != 0) return status;
    const dim3 grid((channels + kThreads - 1) / kThreads, batch);
    state_update_kernel<TX, TS><<<grid, kThreads, 0, stream>>>(
        static_cast<const TX*>(x), x_stride, rows, seq_len, channels, kernel_size);
    return berrylm::launch_status();
}

// Fills `groups` from the launchers' `outs`, `widths` and `num_groups`;
// false unless 1 to kMaxGroups widths sum to `channels`.
inline bool output_groups(void* const* outs, const int* widths, int num_groups, int channels,
                          OutputGroups& groups) {
    if (num_groups < 1 || num_groups > kMaxGroups) return false;
    int start = 0;
    for (int g = 0; g < num_groups; ++g) {
        groups.out[g] = outs[g];
        groups.start[g] = start;
        groups.width[g] = widths[g];
        start += widths[g];
    }
    groups.count = num_groups;
    return start == channels;
}

}  // namespace berrylm::conv

using namespace berrylm::conv;

// `outs[g]` receives the `widths[g]` channels after those of the groups before
// it; the widths sum to `channels`. Sequence b reads its state from row
// slots[b] of `state` ([state_rows, C, K] in `state_dtype`) and writes the
// new one to that row of `new_state`; with `slots` null, row b (state_rows =
// batch). `new_state` may equal `state`: a pool read and updated in place,
// whose slots must be distinct. A slot >= state_rows makes its sequence a
// pad row (a zero state, none written). Time step t of sequence b is the row
// of x at (b T + t) x_stride, x_stride >= channels (a view of the channels
// of a wider projection's output is read in place).
extern "C" int berrylm_causal_conv1d(int x_dtype, int state_dtype, const void* x,
                                     long long x_stride, const float* weight, const void* state,
                                     void* new_state, const uint32_t* slots, int state_rows,
                                     void* const* outs,
                                     const int* widths, int num_groups, int batch, int seq_len,
                                     int channels, int kernel_size, void* stream) {
    if (batch == 0 || channels == 0 || kernel_size <= 0) return 0;
    OutputGroups groups{};
    if (batch > 65535 || state_rows < 0 || x_stride < channels ||
        !output_groups(outs, widths, num_groups, channels, groups)) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(x_dtype, TX, {
        BERRYLM_DISPATCH_DTYPE(state_dtype, TS, {
            const StateRows<TS> rows{static_cast<const TS*>(state), static_cast<TS*>(new_state),
                                     slots, state_rows};
            if (state == new_state) {
                return launch_in_place<TX, TS>(x, x_stride, weight, rows, groups, batch, seq_len,
                                               channels, kernel_size, s);
            }
            return launch<TX, TS>(x, x_stride, weight, rows, groups, batch, seq_len, channels,
                                  kernel_size, s);
        });
    });
    return 0;
}
