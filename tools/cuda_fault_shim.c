/* A fault injector for the device tests of model errors
 * (tests/tests/server_model_errors.rs, run by `tools/gpu-suite.sh model-errors`).
 *
 * Preloaded into `mistralrs serve` (LD_PRELOAD), it stands in front of the CUDA
 * driver's cuLaunchKernel, through which candle launches its kernels. It passes
 * every launch on until the file named by BERRYLM_FAULT_TRIGGER exists; then,
 * by the file's first word:
 *   once    the next launch fails with CUDA_ERROR_OUT_OF_MEMORY (a step that
 *           fails and leaves the device usable), and the file is removed;
 *   sticky  every launch from then on fails with CUDA_ERROR_ILLEGAL_ADDRESS, as
 *           on a context poisoned by an out-of-bounds access.
 * The server's own code is untouched: this is the driver failing under it.
 *
 *   cc -O2 -shared -fPIC -o libcuda_fault_shim.so tools/cuda_fault_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;

enum {
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
};

typedef CUresult (*launch_kernel_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, unsigned, unsigned, CUstream, void **, void **);

static int poisoned;

/* The fault the trigger file asks for now, or 0 (CUDA_SUCCESS) for none. */
static CUresult requested_fault(void) {
    if (poisoned) {
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    const char *trigger = getenv("BERRYLM_FAULT_TRIGGER");
    if (trigger == NULL || access(trigger, F_OK) != 0) {
        return 0;
    }
    char mode[16] = {0};
    FILE *file = fopen(trigger, "r");
    if (file == NULL) {
        return 0;
    }
    if (fscanf(file, "%15s", mode) != 1) {
        mode[0] = '\0';
    }
    fclose(file);
    if (strcmp(mode, "sticky") == 0) {
        poisoned = 1;
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    if (strcmp(mode, "once") == 0 && unlink(trigger) == 0) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return 0;
}

CUresult cuLaunchKernel(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                        unsigned block_x, unsigned block_y, unsigned block_z,
                        unsigned shared_bytes, CUstream stream, void **params, void **extra) {
    static launch_kernel_fn driver_launch;
    CUresult fault = requested_fault();
    if (fault != 0) {
        return fault;
    }
    if (driver_launch == NULL) {
        driver_launch = (launch_kernel_fn)dlsym(RTLD_NEXT, "cuLaunchKernel");
    }
    return driver_launch(function, grid_x, grid_y, grid_z, block_x, block_y, block_z,
                         shared_bytes, stream, params, extra);
}
