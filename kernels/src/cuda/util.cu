// Error reporting and the sources' digest, for the Rust bindings.
#include "common.cuh"

extern "C" const char* berrylm_cuda_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// The digest of the sources this library was built from (build.rs).
extern "C" unsigned long long berrylm_sources_digest() { return BERRYLM_SOURCES_DIGEST; }
