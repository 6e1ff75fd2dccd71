// The few CUDA driver calls of stream-ordered exchanges, found with dlopen at
// run time so that libhalo builds and runs where there is no CUDA. The types
// are the driver ABI's own (CUresult is int, handles are pointers,
// CUdeviceptr is 64 bits); cuda.h is not needed to build.
#ifndef HALO_CUDA_DRIVER_H
#define HALO_CUDA_DRIVER_H
#include <stddef.h>
#include <stdint.h>

// Hidden: libhalo's only exports are include/halo.h's functions, and these
// would read as part of it (tests/python/test_abi.py checks the exports).
#pragma GCC visibility push(hidden)

// halo_cu_load returns 0 or writes why the driver is unusable into why.
int halo_cu_load(char *why, size_t n);
int halo_cu_error(int rc, char *msg, size_t n);
int halo_cu_ctx_get_current(uintptr_t *ctx);
int halo_cu_ctx_set_current(uintptr_t ctx);
int halo_cu_event_create(uintptr_t *ev);
int halo_cu_event_record(uintptr_t ev, uintptr_t stream);
int halo_cu_event_query(uintptr_t ev);
int halo_cu_event_destroy(uintptr_t ev);
int halo_cu_flag_alloc(void **host, uint64_t *dev);
int halo_cu_flag_free(void *host);
int halo_cu_stream_wait_value32(uintptr_t stream, uint64_t dev, uint32_t value);
#pragma GCC visibility pop
#endif
