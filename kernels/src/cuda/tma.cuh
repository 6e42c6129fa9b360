// Hopper's tensor memory accelerator (TMA, sm_90): one thread asks for a
// whole box of a tensor in global memory (described by a `CUtensorMap` made
// on the host), which lands in shared memory in the layout the map names
// (here the 128-byte swizzle of wgmma.cuh), and the bytes that arrive are
// counted on an mbarrier that the consumers wait on. The PTX helpers of the
// kernels, and the host's encoding of a map.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common.cuh"

namespace berrylm::tma {

// Bytes of one row of a 128-byte-swizzled tile: 64 16-bit elements.
constexpr int kSwizzledRowBytes = 128;

// Byte offset of the 16-byte chunk `chunk` (0..7) of row `row` in a tile
// stored with the 128-byte swizzle (as the TMA writes a box with
// CU_TENSOR_MAP_SWIZZLE_128B into a 1024-aligned buffer): the chunks of row
// r are permuted by XOR with r % 8, so that the 8 rows a product or an
// ldmatrix reads at one column lie in 8 different bank groups.
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
    return row * kSwizzledRowBytes + ((chunk ^ (row & 7)) << 4);
}

// Orders this thread's generic-proxy accesses to shared memory (cp.async,
// plain stores, ldmatrix reads, and those of other threads made visible to it
// by a barrier) before the async proxy's (the TMA's writes, the warpgroup
// products' reads) that follow.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Initialises the mbarrier at `barrier` for `arrivals` arrivals a phase.
__device__ __forceinline__ void barrier_init(uint64_t* barrier, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)),
                 "r"(arrivals)
                 : "memory");
}

// Makes the initialisations above visible to the TMA unit (the async proxy).
__device__ __forceinline__ void barrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives on `barrier` and tells it `bytes` more bytes are coming in this
// phase: the phase completes when they have all landed.
__device__ __forceinline__ void barrier_expect_bytes(uint64_t* barrier, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     shared_address(barrier)),
                 "r"(bytes)
                 : "memory");
}

// Waits until the phase of `barrier` with parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* barrier, unsigned parity) {
    const uint32_t address = shared_address(barrier);
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" ::"r"(address),
        "r"(parity)
        : "memory");
}

// Starts loading the box of the 2-dimensional tensor `map` at coordinates
// (c0, c1) (c0 the contiguous dimension) into `dst`; its bytes are counted on
// `barrier`. Elements past the tensor's extents land as zeros.
__device__ __forceinline__ void load_2d(void* dst, const CUtensorMap* map, uint64_t* barrier,
                                        int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];" ::"r"(shared_address(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(barrier)), "r"(c0), "r"(c1)
        : "memory");
}

// The same for a 4-dimensional tensor, at (c0, c1, c2, c3).
__device__ __forceinline__ void load_4d(void* dst, const CUtensorMap* map, uint64_t* barrier,
                                        int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(shared_address(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(barrier)), "r"(c0), "r"(c1),
        "r"(c2), "r"(c3)
        : "memory");
}

// The driver's cuTensorMapEncodeTiled, found once through the runtime (the
// kernels link the runtime only); null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
        void* function = nullptr;
        cudaDriverEntryPointQueryResult found;
        const cudaError_t status = cudaGetDriverEntryPointByVersion(
            "cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found);
        return status == cudaSuccess && found == cudaDriverEntryPointSuccess
                   ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function)
                   : nullptr;
    }();
    return encoder;
}

// The map of a tensor of 16-bit elements at `base`: `dims` its extents
// (contiguous dimension first), `byte_strides` the strides of the others in
// bytes, read in boxes of `box` elements (its first extent 64: one 128-byte
// row) that land with the 128-byte swizzle of wgmma.cuh; elements past an
// extent land as zeros. False where the driver refuses it (alignment,
// strides that are not multiples of 16 bytes).
template <int Rank>
inline bool encode_swizzled_map(CUtensorMap* map, const void* base,
                                const cuuint64_t (&dims)[Rank],
                                const cuuint64_t (&byte_strides)[Rank - 1],
                                const cuuint32_t (&box)[Rank]) {
    const auto encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    cuuint32_t element_strides[Rank];
    for (int i = 0; i < Rank; ++i) element_strides[i] = 1;
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, Rank, const_cast<void*>(base), dims,
                  byte_strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace berrylm::tma
