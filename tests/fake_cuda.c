/* A fake CUDA driver for fastllm's probe tests.
 *
 * Built by the test suite with `cc -shared -fPIC`. Its behaviour is chosen by
 * FAKE_CUDA_MODE:
 *   ok          FAKE_CUDA_DEVICES devices (default 2), all queries succeed
 *   zero        cuInit succeeds, cuDeviceGetCount returns 0
 *   no_device   cuInit returns CUDA_ERROR_NO_DEVICE (100)
 *   segv        cuInit dereferences a null pointer (SIGSEGV)
 *   hang        cuInit never returns
 *   exit3       cuInit calls exit(3)
 *   ctor_segv   the library's constructor crashes while it is being loaded
 *   long_name   cuDeviceGetName fills the whole buffer with no NUL
 * If FAKE_CUDA_MARKER names a file, every load of the library appends one
 * line to it, so a test can tell whether (and how often) it was loaded.
 * Compiled with -DFAKE_NO_CUINIT the library lacks the cuInit symbol.
 *
 * The launch entry points exist so fastllm's CUDA layer can get as far as
 * loading a module: cuDevicePrimaryCtxRetain and cuCtxSetCurrent succeed,
 * cuModuleLoadData fails with CUDA_ERROR_INVALID_IMAGE (200) (this driver
 * runs no code), and cuModuleGetFunction / cuLaunchKernel with
 * CUDA_ERROR_INVALID_HANDLE (400).
 *
 * Device i is "Fake GPU i" with (i + 1) * 16 GiB and compute capability
 * 9.0 for even i, 8.6 for odd i; the driver version is 12040.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *mode(void) {
    const char *m = getenv("FAKE_CUDA_MODE");
    return m ? m : "ok";
}

static int is(const char *m) { return strcmp(mode(), m) == 0; }

__attribute__((constructor)) static void fake_cuda_loaded(void) {
    const char *marker = getenv("FAKE_CUDA_MARKER");
    if (marker) {
        FILE *f = fopen(marker, "a");
        if (f) {
            fprintf(f, "loaded by %d\n", (int)getpid());
            fclose(f);
        }
    }
    if (is("ctor_segv")) {
        *(volatile int *)NULL = 1;
    }
}

static int device_count(void) {
    if (is("zero")) return 0;
    const char *n = getenv("FAKE_CUDA_DEVICES");
    return n ? atoi(n) : 2;
}

#ifndef FAKE_NO_CUINIT
int cuInit(unsigned int flags) {
    (void)flags;
    if (is("no_device")) return 100;
    if (is("segv")) *(volatile int *)NULL = 1;
    if (is("hang")) for (;;) pause();
    if (is("exit3")) exit(3);
    return 0;
}
#endif

int cuDriverGetVersion(int *version) {
    *version = 12040;
    return 0;
}

int cuDeviceGetCount(int *count) {
    *count = device_count();
    return 0;
}

int cuDeviceGet(int *device, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return 101;
    *device = ordinal;
    return 0;
}

int cuDeviceGetName(char *name, int len, int device) {
    if (is("long_name")) {
        memset(name, 'X', (size_t)len);
        return 0;
    }
    snprintf(name, (size_t)len, "Fake GPU %d", device);
    return 0;
}

int cuDeviceTotalMem_v2(size_t *bytes, int device) {
    *bytes = (size_t)(device + 1) * 16 * 1024 * 1024 * 1024;
    return 0;
}

int cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (attribute == 75) *value = device % 2 == 0 ? 9 : 8;
    else if (attribute == 76) *value = device % 2 == 0 ? 0 : 6;
    else return 1;
    return 0;
}

int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    if (device < 0 || device >= device_count()) return 101;
    *ctx = (void *)(size_t)(0x1000 + device);
    return 0;
}

int cuCtxSetCurrent(void *ctx) {
    (void)ctx;
    return 0;
}

int cuModuleLoadData(void **module, const void *image) {
    (void)module;
    (void)image;
    return 200;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    (void)function;
    (void)module;
    (void)name;
    return 400;
}

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz;
    (void)shared; (void)stream; (void)params; (void)extra;
    return 400;
}

int cuGetErrorName(int error, const char **name) {
    switch (error) {
    case 200: *name = "CUDA_ERROR_INVALID_IMAGE"; return 0;
    case 400: *name = "CUDA_ERROR_INVALID_HANDLE"; return 0;
    case 100: *name = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 101: *name = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return 0;
    default: return 1;
    }
}
