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
 *                        0, and the communicator stays usable.
 *   test_plans orders    2 ranks with two exchanges in flight whose shard
 *                        lengths change, so both agree again inside their
 *                        waits and tests: rank 0 waits the first and then
 *                        the second, rank 1 polls the second's test until it
 *                        is done and then waits the first (and on odd steps
 *                        the same through halo_exchange_start's requests).
 *                        Under a 2 s deadline every step must finish in well
 *                        under it, with the right values. */
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

/* One layout of rank_orders: its halos, and each rank's length per step. */
#define ORDER_STEPS 6
static const int64_t order_halo[2][2] = {{2, 1}, {1, 1}};
static const int64_t order_len[2][ORDER_STEPS][2] = {
    {{3, 3}, {3, 5}, {0, 4}, {3, 1}, {3, 1}, {5, 5}},
    {{2, 2}, {2, 3}, {4, 1}, {2, 2}, {2, 2}, {1, 0}},
};

static int rank_orders(int port) {
    const int64_t timeout_ms = 2000;
    halo_comm_t c = make_comm(port, timeout_ms);
    halo_plan_t cache[2][MAXN + 1] = {{0}}; /* per layout, by this rank's own length */
    for (int s = 0; s < ORDER_STEPS; s++) {
        halo_plan_t plan[2];
        double x[2][MAXN + 1], out[2][MAXN + 4];
        int64_t n[2], off[2], total[2];
        for (int k = 0; k < 2; k++) {
            const int64_t *len = order_len[k][s];
            n[k] = len[g_rank];
            off[k] = g_rank ? len[0] : 0;
            total[k] = len[0] + len[1];
            if (!cache[k][n[k]]) {
                int64_t shape[1] = {n[k]};
                halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
                p.dtype = HALO_FLOAT64;
                p.ndim = 1;
                p.shape = shape;
                p.left = order_halo[k][0];
                p.right = order_halo[k][1];
                p.field_mask = HALO_PLAN_PARAM_DEFERRED;
                HALO_OK(halo_plan_create(c, &p, &cache[k][n[k]]));
            }
            plan[k] = cache[k][n[k]];
            for (int64_t i = 0; i < n[k]; i++) x[k][i] = (double)(off[k] + i + 1);
        }
        double t0 = now_s();
        int requests = s % 2;
        halo_request_t req[2] = {0};
        for (int k = 0; k < 2; k++) {
            if (requests) {
                void *bufs[2] = {x[k], out[k]};
                HALO_OK(halo_exchange_start(plan[k], HALO_DIR_FORWARD, bufs, 2, NULL, &req[k]));
            } else {
                HALO_OK(halo_plan_forward_start(plan[k], x[k], out[k]));
            }
        }
        if (g_rank == 0) {
            for (int k = 0; k < 2; k++) HALO_OK(requests ? halo_request_wait(req[k], NULL) : halo_plan_wait(plan[k], HALO_DIR_FORWARD));
        } else {
            int done = 0;
            while (!done && now_s() - t0 < 5)
                HALO_OK(requests ? halo_request_test(req[1], &done) : halo_plan_test(plan[1], HALO_DIR_FORWARD, &done));
            CHECK(done, "step %d: the second exchange's test never reported done", s);
            HALO_OK(requests ? halo_request_wait(req[0], NULL) : halo_plan_wait(plan[0], HALO_DIR_FORWARD));
        }
        CHECK(now_s() - t0 < timeout_ms / 2000.0, "step %d: the exchanges took %.1fs (a deadline)", s, now_s() - t0);
        for (int k = 0; k < 2; k++) {
            if (requests) HALO_OK(halo_request_free(req[k]));
            int64_t Lk = order_halo[k][0], Rk = order_halo[k][1];
            for (int64_t j = 0; j < Lk + n[k] + Rk; j++) {
                int64_t g = off[k] - Lk + j;
                double want = g >= 0 && g < total[k] ? (double)(g + 1) : 0.0;
                CHECK(out[k][j] == want, "step %d layout %d: rank %d out[%lld] = %g, want %g", s, k, g_rank, (long long)j, out[k][j], want);
            }
        }
    }
    for (int k = 0; k < 2; k++)
        for (int n = 0; n <= MAXN; n++)
            if (cache[k][n]) HALO_OK(halo_plan_destroy(cache[k][n]));
    HALO_OK(halo_comm_destroy(c));
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "steps";
    if (rank_args(argc, argv, &port)) {
        if (has_flag(argc, argv, "creation")) return rank_creation(port);
        if (has_flag(argc, argv, "orders")) return rank_orders(port);
        return rank_steps(port);
    }
    char *extra[1] = {(char *)mode};
    int bad;
    if (!strcmp(mode, "steps"))
        bad = launch(argv[0], W, 120, NULL, 1, extra);
    else if (!strcmp(mode, "creation") || !strcmp(mode, "orders"))
        bad = launch(argv[0], 2, 120, NULL, 1, extra);
    else {
        fprintf(stderr, "usage: %s steps|creation|orders\n", argv[0]);
        return 2;
    }
    printf("test_plans %s: %s\n", mode, bad ? "FAILED" : "passed");
    return bad ? 1 : 0;
}
