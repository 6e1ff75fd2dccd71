#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include "driver.h"

// Values of cuda.h that the calls below need.
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_MEMHOSTALLOC_PORTABLE 0x1
#define CU_MEMHOSTALLOC_DEVICEMAP 0x2
#define CU_STREAM_WAIT_VALUE_GEQ 0x0

static struct {
    int (*init)(unsigned);
    int (*get_error_string)(int, const char **);
    int (*ctx_get_current)(void **);
    int (*ctx_set_current)(void *);
    int (*event_create)(void **, unsigned);
    int (*event_record)(void *, void *);
    int (*event_query)(void *);
    int (*event_destroy)(void *);
    int (*mem_host_alloc)(void **, size_t, unsigned);
    int (*mem_host_get_device_pointer)(uint64_t *, void *, unsigned);
    int (*mem_free_host)(void *);
    int (*stream_wait_value32)(void *, uint64_t, uint32_t, unsigned);
} cu;

// Versioned names first: CUDA 12's cuda.h maps cuStreamWaitValue32 to its
// _v2, whose semantics need no opt-in; the plain name is the CUDA 11 one.
static void *sym(void *lib, const char *a, const char *b) {
    void *p = dlsym(lib, a);
    return p || b == NULL ? p : dlsym(lib, b);
}

int halo_cu_load(char *why, size_t n) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(why, n, "cannot load the CUDA driver libcuda.so.1: %s", dlerror());
        return -1;
    }
#define LOAD(field, a, b)                                                                     \
    if ((*(void **)&cu.field = sym(lib, a, b)) == NULL) {                                       \
        snprintf(why, n, "the CUDA driver libcuda.so.1 has no %s (a driver older than CUDA 12?)", a); \
        return -1;                                                                              \
    }
    LOAD(init, "cuInit", NULL)
    LOAD(get_error_string, "cuGetErrorString", NULL)
    LOAD(ctx_get_current, "cuCtxGetCurrent", NULL)
    LOAD(ctx_set_current, "cuCtxSetCurrent", NULL)
    LOAD(event_create, "cuEventCreate", NULL)
    LOAD(event_record, "cuEventRecord", NULL)
    LOAD(event_query, "cuEventQuery", NULL)
    LOAD(event_destroy, "cuEventDestroy_v2", "cuEventDestroy")
    LOAD(mem_host_alloc, "cuMemHostAlloc", NULL)
    LOAD(mem_host_get_device_pointer, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
    LOAD(mem_free_host, "cuMemFreeHost", NULL)
    LOAD(stream_wait_value32, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
#undef LOAD
    int rc = cu.init(0);
    if (rc != 0) {
        char msg[256];
        halo_cu_error(rc, msg, sizeof msg);
        snprintf(why, n, "the CUDA driver libcuda.so.1 loaded but cuInit failed: %s", msg);
        return -1;
    }
    return 0;
}

int halo_cu_error(int rc, char *msg, size_t n) {
    const char *s = NULL;
    if (cu.get_error_string == NULL || cu.get_error_string(rc, &s) != 0 || s == NULL) s = "unknown CUDA error";
    snprintf(msg, n, "%s (CUresult %d)", s, rc);
    return rc;
}

// Handles are numbers on the Go side (driver.h); here they become the
// driver's pointer types again.
int halo_cu_ctx_get_current(uintptr_t *ctx) {
    void *c = NULL;
    int rc = cu.ctx_get_current(&c);
    *ctx = (uintptr_t)c;
    return rc;
}
int halo_cu_ctx_set_current(uintptr_t ctx) { return cu.ctx_set_current((void *)ctx); }
int halo_cu_event_create(uintptr_t *ev) {
    void *e = NULL;
    int rc = cu.event_create(&e, CU_EVENT_DISABLE_TIMING);
    *ev = (uintptr_t)e;
    return rc;
}
int halo_cu_event_record(uintptr_t ev, uintptr_t stream) { return cu.event_record((void *)ev, (void *)stream); }
int halo_cu_event_query(uintptr_t ev) { return cu.event_query((void *)ev); }
int halo_cu_event_destroy(uintptr_t ev) { return cu.event_destroy((void *)ev); }

// The flag is host memory mapped into the device: the proxy writes it with a
// plain store, the stream reads it over the bus.
int halo_cu_flag_alloc(void **host, uint64_t *dev) {
    int rc = cu.mem_host_alloc(host, sizeof(uint32_t), CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    if (rc != 0) return rc;
    *(volatile uint32_t *)*host = 0;
    rc = cu.mem_host_get_device_pointer(dev, *host, 0);
    if (rc != 0) cu.mem_free_host(*host);
    return rc;
}

int halo_cu_flag_free(void *host) { return cu.mem_free_host(host); }

int halo_cu_stream_wait_value32(uintptr_t stream, uint64_t dev, uint32_t value) {
    return cu.stream_wait_value32((void *)stream, dev, value, CU_STREAM_WAIT_VALUE_GEQ);
}
