/* halo_exchange_start and its requests (include/halo.h, 0.4) across 3 real
 * processes: every form (padded and halos-only, forward and backward, single
 * and multi-layout), float32 and bfloat16, bit-identical to the 0.3 blocking
 * calls on the same data; then bad input, each refused with the code and a
 * message that names what was wrong.
 *
 *   test_request            requests without a stream (the host path)
 *   test_request --stream   stream-ordered requests, run with
 *                           HALO_CUDA_DRIVER=host-fake: the proxy path on
 *                           host memory, waited for on the host and under
 *                           another stream than the start's
 *   test_request --abort    (host-fake) rank 1 never starts: halo_comm_abort
 *                           ends the stream-ordered exchange in flight and
 *                           the one queued behind it, both COMM_FAILED
 *   test_request --order    (host-fake) host calls made while stream-ordered
 *                           exchanges are queued run after them, on every
 *                           rank, whatever the proxy's pace */
#include "launch.h"

enum { T = 5, C = 3, B = 2, L = 2, R = 1 };
#define NX (B * T * C)
#define NOUT (B * (T + L + R) * C)
#define NL (B * L * C)
#define NR (B * R * C)

static int g_stream;
static void *const S1 = (void *)(uintptr_t)0x51, *const S2 = (void *)(uintptr_t)0x52;

static uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* Small integers: exact in both dtypes, so sums are deterministic too. */
static void fill(void *p, int dtype, int n, int seed) {
    for (int i = 0; i < n; i++) {
        float v = (float)((i * 7 + seed * 13) % 17 - 8);
        if (dtype == HALO_FLOAT32) ((float *)p)[i] = v;
        else ((uint16_t *)p)[i] = bf16(v);
    }
}

static halo_plan_params_t params(int dtype, int halos_only, const int64_t *shape) {
    halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
    p.dtype = (halo_dtype_t)dtype;
    p.ndim = 3;
    p.shape = shape;
    p.dim = 1;
    p.left = L;
    p.right = R;
    if (halos_only) {
        p.field_mask |= HALO_PLAN_PARAM_HALOS_ONLY;
        p.halos_only = 1;
    }
    return p;
}

/* One exchange through the new call; the stream-ordered ones alternate
 * between a host wait and a wait under another stream followed by one. */
static void exchange(halo_plan_t plan, halo_direction_t dir, void *const *bufs, size_t n) {
    halo_request_t req;
    HALO_OK(halo_exchange_start(plan, dir, bufs, n, g_stream ? S1 : NULL, &req));
    if (g_stream && dir == HALO_DIR_BACKWARD) HALO_OK(halo_request_wait(req, S2));
    int done = 0;
    HALO_OK(halo_request_test(req, &done));
    HALO_OK(halo_request_wait(req, NULL));
    HALO_OK(halo_request_test(req, &done));
    CHECK(done == 1, "test after wait says not done");
    HALO_OK(halo_request_free(req));
}

static size_t esize(int dtype) { return dtype == HALO_FLOAT32 ? 4 : 2; }

/* Padded: x -> out, grad_out -> grad_x; halos-only: x -> left, right and
 * grad_left, grad_right -> grad_x (added to). Old calls, then the new. */
static void check_forms(halo_comm_t c, int dtype) {
    int64_t shape[3] = {B, T, C};
    size_t e = esize(dtype);
    for (int halos = 0; halos < 2; halos++) {
        halo_plan_params_t p = params(dtype, halos, shape);
        halo_plan_t plan;
        HALO_OK(halo_plan_create(c, &p, &plan));
        unsigned char x[NX * 4], out[2][NOUT * 4], gx[2][NX * 4], lt[2][NL * 4], rt[2][NR * 4];
        fill(x, dtype, NX, g_rank);
        for (int k = 0; k < 2; k++) {
            memset(out[k], 0x7f, sizeof out[k]);
            fill(lt[k], dtype, NL, g_rank + 5);
            fill(rt[k], dtype, NR, g_rank + 9);
            fill(gx[k], dtype, NX, g_rank + 3);
        }
        if (!halos) {
            HALO_OK(halo_plan_forward(plan, x, out[0]));
            HALO_OK(halo_plan_backward(plan, out[0], gx[0]));
            void *f[2] = {x, out[1]}, *b[2] = {out[1], gx[1]};
            exchange(plan, HALO_DIR_FORWARD, f, 2);
            exchange(plan, HALO_DIR_BACKWARD, b, 2);
            CHECK(!memcmp(out[0], out[1], NOUT * e), "padded forward (dtype %d) differs from halo_plan_forward", dtype);
        } else {
            HALO_OK(halo_plan_halos_forward(plan, x, lt[0], rt[0]));
            HALO_OK(halo_plan_halos_backward(plan, lt[0], rt[0], gx[0]));
            void *f[3] = {x, lt[1], rt[1]}, *b[3] = {lt[1], rt[1], gx[1]};
            exchange(plan, HALO_DIR_FORWARD, f, 3);
            exchange(plan, HALO_DIR_BACKWARD, b, 3);
            CHECK(!memcmp(lt[0], lt[1], NL * e) && !memcmp(rt[0], rt[1], NR * e),
                  "halos-only forward (dtype %d) differs from halo_plan_halos_forward", dtype);
        }
        CHECK(!memcmp(gx[0], gx[1], NX * e), "%s backward (dtype %d) differs from the 0.3 call", halos ? "halos-only" : "padded", dtype);
        HALO_OK(halo_plan_destroy(plan));
    }
}

/* Two layouts (float32 and bfloat16) through one request. */
static void check_multi(halo_comm_t c) {
    int64_t shape[3] = {B, T, C};
    halo_plan_params_t p[2] = {params(HALO_FLOAT32, 0, shape), params(HALO_BFLOAT16, 0, shape)};
    halo_plan_t plan;
    HALO_OK(halo_plan_create_multi(c, 2, p, &plan));
    float x0[NX], o0[2][NOUT], g0[2][NX];
    uint16_t x1[NX], o1[2][NOUT], g1[2][NX];
    fill(x0, HALO_FLOAT32, NX, g_rank);
    fill(x1, HALO_BFLOAT16, NX, g_rank + 1);
    memset(o0, 0, sizeof o0);
    memset(o1, 0, sizeof o1);
    const void *xs[2] = {x0, x1};
    void *outs[2] = {o0[0], o1[0]}, *gxs[2] = {g0[0], g1[0]};
    HALO_OK(halo_plan_forward_multi(plan, xs, outs));
    HALO_OK(halo_plan_backward_multi(plan, (const void *const *)outs, gxs));
    void *f[4] = {x0, o0[1], x1, o1[1]}, *b[4] = {o0[1], g0[1], o1[1], g1[1]};
    exchange(plan, HALO_DIR_FORWARD, f, 4);
    exchange(plan, HALO_DIR_BACKWARD, b, 4);
    CHECK(!memcmp(o0[0], o0[1], sizeof o0[0]) && !memcmp(o1[0], o1[1], sizeof o1[0]), "multi forward differs");
    CHECK(!memcmp(g0[0], g0[1], sizeof g0[0]) && !memcmp(g1[0], g1[1], sizeof g1[0]), "multi backward differs");
    HALO_OK(halo_plan_destroy(plan));
}

#define EXPECT(call, code, words)                                                                     \
    do {                                                                                              \
        halo_result_t rc_ = (call);                                                                   \
        CHECK(rc_ == (code), "%s -> %s, want %s (%s)", #call, halo_strerror(rc_), halo_strerror(code), \
              halo_last_error());                                                                     \
        CHECK(strstr(halo_last_error(), words) != NULL, "%s: message '%s' lacks '%s'", #call,          \
              halo_last_error(), words);                                                              \
    } while (0)

static void check_bad_input(halo_comm_t c) {
    int64_t shape[3] = {B, T, C};
    halo_plan_params_t p = params(HALO_FLOAT32, 0, shape);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[NX], out[NOUT];
    fill(x, HALO_FLOAT32, NX, g_rank);
    void *bufs[3] = {x, out, out};
    halo_request_t req = (halo_request_t)(uintptr_t)0x5a5a;
    EXPECT(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 3, NULL, &req), HALO_ERR_INVALID_ARGUMENT, "count is 3 but");
    EXPECT(halo_exchange_start(plan, HALO_DIR_FORWARD, NULL, 2, NULL, &req), HALO_ERR_INVALID_ARGUMENT, "buffers is NULL");
    EXPECT(halo_exchange_start(plan, (halo_direction_t)7, bufs, 2, NULL, &req), HALO_ERR_INVALID_ARGUMENT, "direction 7");
    EXPECT(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 2, NULL, NULL), HALO_ERR_INVALID_ARGUMENT, "request");
    EXPECT(halo_exchange_start(NULL, HALO_DIR_FORWARD, bufs, 2, NULL, &req), HALO_ERR_INVALID_HANDLE, "NULL");
    CHECK(req == (halo_request_t)(uintptr_t)0x5a5a, "the request was written on failure");
    int done;
    EXPECT(halo_request_test(NULL, &done), HALO_ERR_INVALID_HANDLE, "request handle is NULL");
    EXPECT(halo_request_wait((halo_request_t)(void *)plan, NULL), HALO_ERR_INVALID_HANDLE, "a plan handle");
    EXPECT(halo_request_free((halo_request_t)(uintptr_t)0x1234), HALO_ERR_INVALID_HANDLE, "not a halo handle");
    if (!g_stream && access("/dev/nvidiactl", F_OK) != 0) /* no GPU here: the driver cannot load */
        EXPECT(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 2, S1, &req), HALO_ERR_INVALID_ARGUMENT, "libcuda.so.1");

    /* A request that cannot end yet (rank 1 starts late) is not freed. */
    if (g_rank == 1) usleep(300 * 1000);
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 2, g_stream ? S1 : NULL, &req));
    if (g_rank != 1) EXPECT(halo_request_free(req), HALO_ERR_INVALID_STATE, "has not ended");
    if (!g_stream) EXPECT(halo_request_wait(req, S2), HALO_ERR_INVALID_ARGUMENT, "without a stream");
    HALO_OK(halo_request_wait(req, NULL));
    HALO_OK(halo_request_free(req));
    EXPECT(halo_request_free(req), HALO_ERR_INVALID_HANDLE, "not live");
    HALO_OK(halo_plan_destroy(plan));
}

static int abort_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[3] = {B, T, C};
    halo_plan_params_t p = params(HALO_FLOAT32, 0, shape);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    if (g_rank != 0) {
        sleep(2); /* alive, never exchanging */
        halo_comm_destroy(c);
        return 0;
    }
    float x[NX], out[NOUT], gx[NX];
    fill(x, HALO_FLOAT32, NX, 0);
    void *f[2] = {x, out}, *b[2] = {out, gx};
    halo_request_t a, q;
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f, 2, S1, &a));
    HALO_OK(halo_exchange_start(plan, HALO_DIR_BACKWARD, b, 2, S2, &q));
    usleep(200 * 1000);
    int done = 1;
    HALO_OK(halo_request_test(a, &done));
    CHECK(done == 0, "the exchange ended with its peer silent");
    double t0 = now_s();
    HALO_OK(halo_comm_abort(c));
    halo_result_t rc = halo_request_wait(a, NULL);
    CHECK(rc == HALO_ERR_COMM_FAILED, "the exchange in flight after abort: %s: %s", halo_strerror(rc), halo_last_error());
    rc = halo_request_wait(q, NULL);
    CHECK(rc == HALO_ERR_COMM_FAILED, "the exchange queued after abort: %s: %s", halo_strerror(rc), halo_last_error());
    CHECK(now_s() - t0 < 2, "abort took %.1f s to end the requests", now_s() - t0);
    HALO_OK(halo_request_free(a));
    HALO_OK(halo_request_free(q));
    halo_plan_destroy(plan);
    halo_comm_destroy(c);
    printf("test_request --abort: rank 0: %d failures\n", g_failures);
    return g_failures ? 1 : 0;
}

/* Three plans (different shapes), exchanged in the same order of calls on
 * both ranks: stream-ordered A and B, then a blocking C on the host. Rank 0
 * makes the three calls at once: its proxy is still waiting in A (rank 1
 * starts late) when the host calls C, with B queued behind A. Rank 1 waits
 * for each exchange before the next call. The calls' numbers, which match
 * messages across ranks, must follow the calls on both, and the proxy and
 * the host must not drive the communicator at the same time. */
static int order_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shapes[3][1] = {{5}, {6}, {7}};
    halo_plan_t plans[3];
    float x[3][8], out[3][8 + L + R], want[3][8 + L + R];
    void *bufs[3][2];
    for (int k = 0; k < 3; k++) {
        halo_plan_params_t p = plan_1d(shapes[k], L, R);
        HALO_OK(halo_plan_create(c, &p, &plans[k]));
        fill(x[k], HALO_FLOAT32, (int)shapes[k][0], g_rank * 3 + k);
        bufs[k][0] = x[k];
        bufs[k][1] = out[k];
    }
    for (int iter = 0; iter < 5; iter++) {
        halo_request_t req[2];
        memset(out, 0x7f, sizeof out);
        if (g_rank == 0) {
            HALO_OK(halo_exchange_start(plans[0], HALO_DIR_FORWARD, bufs[0], 2, S1, &req[0]));
            HALO_OK(halo_exchange_start(plans[1], HALO_DIR_FORWARD, bufs[1], 2, S1, &req[1]));
            HALO_OK(halo_plan_forward(plans[2], x[2], out[2]));
            for (int k = 0; k < 2; k++) HALO_OK(halo_request_wait(req[k], NULL));
        } else {
            usleep(100 * 1000);
            for (int k = 0; k < 2; k++) {
                HALO_OK(halo_exchange_start(plans[k], HALO_DIR_FORWARD, bufs[k], 2, S1, &req[k]));
                HALO_OK(halo_request_wait(req[k], NULL));
            }
            HALO_OK(halo_plan_forward(plans[2], x[2], out[2]));
        }
        for (int k = 0; k < 2; k++) HALO_OK(halo_request_free(req[k]));
        if (iter == 0) memcpy(want, out, sizeof want);
        for (int k = 0; k < 3; k++) {
            /* Rank 0's right halo is rank 1's first R slices; rank 1's left halo rank 0's last L. */
            float peer[8];
            fill(peer, HALO_FLOAT32, (int)shapes[k][0], (1 - g_rank) * 3 + k);
            int n = (int)shapes[k][0];
            const float *got = g_rank == 0 ? out[k] + L + n : out[k];
            const float *exp = g_rank == 0 ? peer : peer + n - L;
            CHECK(!memcmp(got, exp, (g_rank == 0 ? R : L) * sizeof(float)), "iteration %d: plan %d (%ld slices): the halo from rank %d is wrong",
                  iter, k, (long)n, 1 - g_rank);
            CHECK(!memcmp(out[k], want[k], (n + L + R) * sizeof(float)), "iteration %d: plan %d differs from iteration 0", iter, k);
        }
    }
    for (int k = 0; k < 3; k++) HALO_OK(halo_plan_destroy(plans[k]));
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --order: rank %d: %d failures\n", g_rank, g_failures);
    return g_failures ? 1 : 0;
}

static int rank_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    check_forms(c, HALO_FLOAT32);
    check_forms(c, HALO_BFLOAT16);
    check_multi(c);
    check_bad_input(c);
    HALO_OK(halo_comm_destroy(c));
    printf("test_request: rank %d: %d failures\n", g_rank, g_failures);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_stream = has_flag(argc, argv, "--stream");
    int aborting = has_flag(argc, argv, "--abort"), ordering = has_flag(argc, argv, "--order");
    halo_comm_params_t unused = HALO_COMM_PARAMS_INITIALIZER;
    (void)unused;
    if (rank_args(argc, argv, &port)) return aborting ? abort_main(port) : ordering ? order_main(port) : rank_main(port);
    char *extra[1] = {aborting ? "--abort" : ordering ? "--order" : "--stream"};
    int bad = launch(argv[0], aborting || ordering ? 2 : 3, 90, NULL, g_stream || aborting || ordering, extra);
    printf("test_request%s: %s\n", aborting ? " --abort" : ordering ? " --order" : g_stream ? " --stream" : "", bad ? "FAILED" : "passed");
    return bad ? 1 : 0;
}
