#include "halo.h"
#include "halo.h"
int check() {
    halo_comm_t c = nullptr;
    halo_request_t r = nullptr;
    halo_comm_params_t cp = HALO_COMM_PARAMS_INITIALIZER;
    halo_plan_params_t pp = HALO_PLAN_PARAMS_INITIALIZER;
    // The call pair's exact types, as in header_check.c.
    halo_result_t (*exchange)(halo_plan_t, halo_direction_t, void *const *, size_t, void *) = halo_exchange;
    halo_result_t (*start)(halo_plan_t, halo_direction_t, void *const *, size_t, void *, halo_request_t *) = halo_exchange_start;
    return c || r || cp.field_mask || pp.field_mask || !exchange || !start ? 1 : HALO_SUCCESS;
}
