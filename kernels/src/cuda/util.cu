// Error reporting shared by the Rust bindings.
#include "common.cuh"

extern "C" const char* berrylm_cuda_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}
