/* What a failed forward leaves behind, as include/halo.h says: exchanges
 * receive straight into the caller's tensors, so after a failed forward the
 * contents of out are unspecified; output parameters (handles) are written
 * only on success; the communicator refuses further work with
 * HALO_ERR_COMM_FAILED and can still be destroyed.
 *
 * Two ranks: rank 1 is alive but never takes part in the forward; rank 0's
 * forward times out after 1 s. */
#include "launch.h"

static int rank_main(int port) {
    halo_comm_t c = make_comm(port, 1000);
    int64_t shape[1] = {1 << 16};
    halo_plan_params_t p = plan_1d(shape, 4, 4);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    if (g_rank == 1) {
        sleep(3); /* alive, silent */
        halo_comm_destroy(c);
        return 0;
    }
    static float x[1 << 16], out[(1 << 16) + 8];
    halo_result_t rc = halo_plan_forward(plan, x, out);
    CHECK(rc == HALO_ERR_TIMEOUT, "forward with a silent peer: %s: %s", halo_strerror(rc), halo_last_error());
    CHECK(strstr(halo_last_error(), "rank 1") != NULL, "the timeout does not name rank 1: %s", halo_last_error());
    rc = halo_plan_forward(plan, x, out);
    CHECK(rc == HALO_ERR_COMM_FAILED, "forward after a failure: %s", halo_strerror(rc));
    rc = halo_plan_backward(plan, out, x);
    CHECK(rc == HALO_ERR_COMM_FAILED, "backward after a failure: %s", halo_strerror(rc));
    halo_plan_t untouched = (halo_plan_t)(uintptr_t)0x5a5a;
    rc = halo_plan_create(c, &p, &untouched);
    CHECK(rc == HALO_ERR_COMM_FAILED, "plan create after a failure: %s", halo_strerror(rc));
    CHECK(untouched == (halo_plan_t)(uintptr_t)0x5a5a, "the plan handle was written on failure");
    int r = -1, w = -1;
    HALO_OK(halo_comm_get_rank(c, &r, &w));
    HALO_OK(halo_plan_destroy(plan));
    HALO_OK(halo_comm_destroy(c));
    printf("test_contract: rank 0: %d failures\n", g_failures);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (rank_args(argc, argv, &port)) return rank_main(port);
    int bad = launch(argv[0], 2, 60, NULL, 0, NULL);
    printf("test_contract: %s\n", bad ? "FAILED" : "passed");
    return bad ? 1 : 0;
}
