/* Plans never go out of step between ranks, through the C ABI (issue 24).
 *
 *   test_plans steps     3 ranks keep a cache of deferred plans keyed by their
 *                        own shard length, as a binding does, over shard
 *                        lengths that change from step to step: a rank whose
 *                        length repeats finds its plan while the others make
 *                        new ones. Every output is checked against the whole
 *                        sequence, and no step may take a deadline.
 *   test_plans creation  2 ranks create a plan that only rank 0 cannot make
 *                        (it needs staging buffers of 2^40 bytes, rank 1
 *                        none): both get the same result code naming rank
 *                        0, and the communicator stays usable. */
#include "launch.h"

#define W 3
#define MAXN 6
#define L 2
#define R 1

static int rank_steps(int port) {
    const int64_t timeout_ms = 10000;
    halo_comm_t c = make_comm(port, timeout_ms);
    /* Lengths of 0, 1, 2 (= L) and 3 (= L + 1) frames; every change keeps
     * some rank's length. */
    static const int64_t steps[][W] = {{2, 3, 0}, {2, 0, 3}, {1, 2, 3}, {2, 3, 0}, {3, 1, 1}, {0, 1, 1}};
    halo_plan_t cache[MAXN + 1] = {0}; /* by this rank's own length */
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        const int64_t *len = steps[s];
        int64_t n = len[g_rank], off = 0, total = 0;
        for (int r = 0; r < W; r++) {
            if (r < g_rank) off += len[r];
            total += len[r];
        }
        if (!cache[n]) {
            int64_t shape[1] = {n};
            halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
            p.dtype = HALO_FLOAT64;
            p.ndim = 1;
            p.shape = shape;
            p.left = L;
            p.right = R;
            p.field_mask = HALO_PLAN_PARAM_DEFERRED;
            HALO_OK(halo_plan_create(c, &p, &cache[n]));
        }
        double x[MAXN + 1], out[MAXN + L + R + 1];
        for (int64_t i = 0; i < n; i++) x[i] = (double)(off + i + 1);
        double t0 = now_s();
        HALO_OK(halo_plan_forward(cache[n], x, out));
        CHECK(now_s() - t0 < timeout_ms / 2000.0, "step %zu: the forward took %.1fs (a deadline)", s, now_s() - t0);
        for (int64_t j = 0; j < L + n + R; j++) {
            int64_t g = off - L + j;
            double want = g >= 0 && g < total ? (double)(g + 1) : 0.0;
            CHECK(out[j] == want, "step %zu: rank %d out[%lld] = %g, want %g", s, g_rank, (long long)j, out[j], want);
        }
    }
    for (int n = 0; n <= MAXN; n++)
        if (cache[n]) HALO_OK(halo_plan_destroy(cache[n]));
    HALO_OK(halo_comm_destroy(c));
    return g_failures ? 1 : 0;
}

static int rank_creation(int port) {
    halo_comm_t c = make_comm(port, 20000);
    /* (2, 2^38) float32, sharded along dim 0, a left halo of one row
     * (2^40 bytes). Rank 1 receives it in place and sends its gradient in
     * place; rank 0 adds that gradient through staging, and its x is
     * column-major, so its row is packed through staging too. */
    int64_t shape[2] = {2, (int64_t)1 << 38};
    int64_t colmajor[2] = {1, 2};
    halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
    p.ndim = 2;
    p.shape = shape;
    p.dim = 0;
    p.left = 1;
    p.right = 0;
    p.field_mask = HALO_PLAN_PARAM_HALOS_ONLY;
    p.halos_only = 1;
    if (g_rank == 0) {
        p.field_mask |= HALO_PLAN_PARAM_X_STRIDES;
        p.x_strides = colmajor;
    }
    halo_plan_t plan = NULL;
    halo_result_t rc = halo_plan_create(c, &p, &plan);
    const char *msg = halo_last_error();
    CHECK(rc != HALO_SUCCESS && plan == NULL, "rank %d: creation that rank 0 cannot make returned %s", g_rank, halo_strerror(rc));
    CHECK(strstr(msg, "rank 0 failed after the ranks agreed") != NULL, "rank %d: message \"%s\" does not name rank 0 alone", g_rank, msg);
    /* Both ranks see the same code: swap them and compare. */
    halo_plan_params_t q = HALO_PLAN_PARAMS_INITIALIZER;
    int64_t one[1] = {1};
    q.dtype = HALO_FLOAT64;
    q.ndim = 1;
    q.shape = one;
    q.left = 1;
    q.right = 1;
    halo_plan_t ok = NULL;
    HALO_OK(halo_plan_create(c, &q, &ok)); /* the communicator is still usable */
    double x[1] = {(double)rc}, out[3];
    HALO_OK(halo_plan_forward(ok, x, out));
    double peer = g_rank == 0 ? out[2] : out[0];
    CHECK(peer == (double)rc, "rank %d: result %d, the peer's %g: creation ended differently", g_rank, (int)rc, peer);
    HALO_OK(halo_plan_destroy(ok));
    HALO_OK(halo_comm_destroy(c));
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "steps";
    if (rank_args(argc, argv, &port)) {
        if (has_flag(argc, argv, "creation")) return rank_creation(port);
        return rank_steps(port);
    }
    char *extra[1] = {(char *)mode};
    int bad;
    if (!strcmp(mode, "steps"))
        bad = launch(argv[0], W, 120, NULL, 1, extra);
    else if (!strcmp(mode, "creation"))
        bad = launch(argv[0], 2, 120, NULL, 1, extra);
    else {
        fprintf(stderr, "usage: %s steps|creation\n", argv[0]);
        return 2;
    }
    printf("test_plans %s: %s\n", mode, bad ? "FAILED" : "passed");
    return bad ? 1 : 0;
}
