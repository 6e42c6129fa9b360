// PTX helpers of the tensor-core kernels (attention.cu, moe_grouped.cu):
// asynchronous global-to-shared copies, ldmatrix fragment loads and the
// m16n8k16 mma.sync with f32 accumulators, for bf16 and f16 operands.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace berrylm::mma {

__device__ __forceinline__ unsigned smem_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// Copies 16 bytes from global to shared memory asynchronously; with
// `src_bytes` 0 it writes 16 zero bytes instead (rows past the end).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)),
                 "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N committed groups of this thread are still pending.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements; lanes 8i..8i+7 give the row addresses
// of matrix i, and r[i] receives this lane's pair of matrix i (row lane / 4,
// columns 2 (lane % 4) and the next).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
}

// The same, each matrix transposed: r[i] holds rows 2 (lane % 4) and the next
// of column lane / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_address(row)));
}

// The mma.sync of `mma_16816` with A and B of PTX type AB ("bf16", "f16").
#define BERRYLM_MMA_16816(AB, c, a, b0, b1)                                          \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 "          \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// c += a b for a 16x16 A (row-major fragment), a 16x8 B (column fragment) and
// a 16x8 f32 C; A and B hold pairs of T, bf16 or f16. C's element i of this
// lane is row lane / 4 + 8 (i / 2), column 2 (lane % 4) + i % 2.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or f16");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        BERRYLM_MMA_16816("bf16", c, a, b0, b1);
    } else {
        BERRYLM_MMA_16816("f16", c, a, b0, b1);
    }
}

#undef BERRYLM_MMA_16816

// Two f32 values rounded to T (RNE) and packed, `lo` in the low half.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);

template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&pair);
}

template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 pair = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&pair);
}

}  // namespace berrylm::mma
