#include "halo.h"
#include "halo.h"
int check() {
    halo_comm_t c = nullptr;
    halo_request_t r = nullptr;
    halo_comm_params_t cp = HALO_COMM_PARAMS_INITIALIZER;
    halo_plan_params_t pp = HALO_PLAN_PARAMS_INITIALIZER;
    return c || r || cp.field_mask || pp.field_mask ? 1 : HALO_SUCCESS;
}
