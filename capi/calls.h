/* The call numbers that halo.c passes to the Go exports: halo.Call's values,
 * checked against Go by abiMismatches. Private to libhalo. */
#ifndef HALO_CAPI_CALLS_H
#define HALO_CAPI_CALLS_H
enum {
    HALO_CALL_FORWARD = 0,
    HALO_CALL_BACKWARD = 1,
    HALO_CALL_HALOS_FORWARD = 2,
    HALO_CALL_HALOS_BACKWARD = 3
};
#endif
