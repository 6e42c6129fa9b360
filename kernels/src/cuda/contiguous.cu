// A strided tensor copied into contiguous memory, its layout passed as kernel
// arguments. candle's own strided copy uploads the dims and strides from host
// memory on every call, which a CUDA graph capture records as a read of that
// host memory at replay time, long after it is freed; this copy reads no host
// memory, so the layers a decode graph captures can make a view contiguous.
#include "common.cuh"

namespace berrylm::contiguous {

constexpr int kMaxRank = 8;
constexpr int kThreads = 256;

struct Layout {
    int rank;
    long long dims[kMaxRank];
    long long strides[kMaxRank];
};

// Element `i` of the contiguous output is the element of `src` at the same
// multi-index: the index's digits in the dims, each times its stride.
template <typename T>
__global__ void copy_strided_kernel(const T* __restrict__ src, T* __restrict__ dst, Layout layout,
                                    long long total) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += step) {
        long long rest = i;
        long long offset = 0;
        for (int d = layout.rank - 1; d >= 0; --d) {
            const long long index = rest % layout.dims[d];
            rest /= layout.dims[d];
            offset += index * layout.strides[d];
        }
        dst[i] = src[offset];
    }
}

template <typename T>
int launch(const void* src, void* dst, const Layout& layout, long long total, cudaStream_t stream) {
    const unsigned int blocks = elementwise_blocks(total, kThreads);
    copy_strided_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(src),
                                                            static_cast<T*>(dst), layout, total);
    return launch_status();
}

}  // namespace berrylm::contiguous

using namespace berrylm::contiguous;

// Copies the `total` elements of the view at `src` (`rank` dims and strides in
// elements) to `dst`, contiguous; elements are 2 or 4 bytes wide.
extern "C" int berrylm_copy_strided(int element_bytes, const void* src, void* dst, int rank,
                                    const long long* dims, const long long* strides,
                                    long long total, void* stream) {
    if (total == 0) return 0;
    if (rank < 1 || rank > kMaxRank) return static_cast<int>(cudaErrorInvalidValue);
    Layout layout{};
    layout.rank = rank;
    for (int d = 0; d < rank; ++d) {
        if (dims[d] < 1 || strides[d] < 0) return static_cast<int>(cudaErrorInvalidValue);
        layout.dims[d] = dims[d];
        layout.strides[d] = strides[d];
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (element_bytes) {
    case 2: return launch<unsigned short>(src, dst, layout, total, s);
    case 4: return launch<unsigned int>(src, dst, layout, total, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
}
