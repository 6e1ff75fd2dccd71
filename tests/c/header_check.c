#include "halo.h"
/* The call pair's exact types: a changed signature fails to compile here. */
static halo_result_t (*const exchange)(halo_plan_t, halo_direction_t, void *const *, size_t, void *) = halo_exchange;
static halo_result_t (*const start)(halo_plan_t, halo_direction_t, void *const *, size_t, void *, halo_request_t *) =
    halo_exchange_start;
int main(void) {
    halo_comm_params_t c = HALO_COMM_PARAMS_INITIALIZER;
    halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
    halo_request_t r = NULL;
    (void)r;
    (void)exchange;
    (void)start;
    return c.field_mask == 0 && p.field_mask == 0 && halo_version_number() == HALO_VERSION_NUMBER ? 0 : 1;
}
