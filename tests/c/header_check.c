#include "halo.h"
int main(void) {
    halo_comm_params_t c = HALO_COMM_PARAMS_INITIALIZER;
    halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
    halo_request_t r = NULL;
    (void)r;
    return c.field_mask == 0 && p.field_mask == 0 && halo_version_number() == HALO_VERSION_NUMBER ? 0 : 1;
}
