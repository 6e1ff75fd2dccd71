/* halo_exchange_start and its requests, and halo_exchange (include/halo.h,
 * 0.4), across 3 real processes: every form (padded and halos-only, forward
 * and backward, single and multi-layout), float32 and bfloat16; each of the
 * 18 deprecated 0.3 calls bit-identical to halo_exchange on the same data;
 * then bad input, each refused with the code and a message that names what
 * was wrong.
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
 *                           rank, whatever the proxy's pace
 *   test_request --small-streams  (host-fake, GOGC=1) thousands of
 *                           start/wait/free on streams 0x1, 0x2, ... on 1 and
 *                           2 ranks: a stream is a number, never a pointer
 *                           to the garbage collector
 *   test_request --queue    (host-fake) thousands of exchanges queued on one
 *                           stream, then on several, before any wait
 *   test_request --queue-abort  (host-fake) the same with a silent peer: an
 *                           abort from another thread ends the start that
 *                           the full stream blocks, COMM_FAILED, at once
 *   test_request --destroyed  (host-fake, 1 rank) requests after their
 *                           communicator was destroyed fail naming it
 *   test_request --owner    an exchange a request started is finished by
 *                           that request only, never by halo_plan_wait/test
 *   test_request --abort-plan  after an abort, halo_plan_test and then
 *                           halo_plan_wait of one exchange both COMM_FAILED
 *   test_request --fork     a forked child destroys the inherited
 *                           communicator and exits: the parent's job goes on */
#include <pthread.h>
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

/* Every exchange call of the header on one plan, from the same starting
 * tensors, forward and backward: halo_exchange gives the reference, and
 * halo_exchange_start (a request) and each 0.3 call (blocking; its _start
 * finished by halo_plan_wait, and by halo_plan_test alone; the _multi forms
 * on a plan of K layouts) must give the same bytes. test_exchange checks the
 * 0.3 calls against an oracle; here they are held to the pair they wrap. */
enum { PAIR, PAIR_START, OLD, OLD_START_WAIT, OLD_START_TEST, NFORMS };
static const char *const form_names[NFORMS] = {"halo_exchange", "halo_exchange_start", "the blocking 0.3 call",
                                               "the 0.3 _start call and halo_plan_wait", "the 0.3 _start call and halo_plan_test"};

/* One layout's tensors: the inputs every form starts from, and what one
 * form wrote. */
typedef struct {
    int dtype;
    unsigned char x[NX * 4], gout[NOUT * 4], gl[NL * 4], gr[NR * 4], gx0[NX * 4];
    unsigned char out[NFORMS][NOUT * 4], lt[NFORMS][NL * 4], rt[NFORMS][NR * 4], gx[NFORMS][NX * 4];
} layout;

/* Finishes a 0.3 _start call: halo_plan_wait, or halo_plan_test until done. */
static void old_finish(halo_plan_t plan, halo_direction_t dir, int form) {
    int done = 0;
    if (form == OLD_START_WAIT) {
        HALO_OK(halo_plan_wait(plan, dir));
        return;
    }
    for (double deadline = now_s() + 30; !done && now_s() < deadline;) HALO_OK(halo_plan_test(plan, dir, &done));
    CHECK(done, "halo_plan_test: the exchange (direction %d) not done in 30 s", dir);
}

/* Runs one direction of one form on plan (K layouts; a single-layout plan
 * takes the single calls, K > 1 the _multi ones). */
static void run_form(halo_plan_t plan, int K, int halos, halo_direction_t dir, int form, layout *ls) {
    int n = halos ? 3 : 2;
    void *bufs[8 * 3], *a[8], *b[8], *c[8];
    for (int k = 0; k < K; k++) {
        layout *l = &ls[k];
        if (dir == HALO_DIR_FORWARD) {
            a[k] = l->x;
            b[k] = halos ? (void *)l->lt[form] : (void *)l->out[form];
            c[k] = l->rt[form];
        } else {
            a[k] = halos ? l->gl : l->gout;
            b[k] = halos ? (void *)l->gr : (void *)l->gx[form];
            c[k] = l->gx[form];
        }
        bufs[n * k] = a[k];
        bufs[n * k + 1] = b[k];
        if (halos) bufs[n * k + 2] = c[k];
    }
    const void *const *ca = (const void *const *)a, *const *cb = (const void *const *)b;
    int fwd = dir == HALO_DIR_FORWARD, start = form != OLD;
    switch (form) {
    case PAIR: HALO_OK(halo_exchange(plan, dir, bufs, (size_t)(n * K), g_stream ? S1 : NULL)); return;
    case PAIR_START: exchange(plan, dir, bufs, (size_t)(n * K)); return;
    }
    if (K == 1 && !halos && fwd) HALO_OK((start ? halo_plan_forward_start : halo_plan_forward)(plan, a[0], b[0]));
    if (K == 1 && !halos && !fwd) HALO_OK((start ? halo_plan_backward_start : halo_plan_backward)(plan, a[0], b[0]));
    if (K == 1 && halos && fwd) HALO_OK((start ? halo_plan_halos_forward_start : halo_plan_halos_forward)(plan, a[0], b[0], c[0]));
    if (K == 1 && halos && !fwd) HALO_OK((start ? halo_plan_halos_backward_start : halo_plan_halos_backward)(plan, a[0], b[0], c[0]));
    if (K > 1 && !halos && fwd) HALO_OK((start ? halo_plan_forward_multi_start : halo_plan_forward_multi)(plan, ca, b));
    if (K > 1 && !halos && !fwd) HALO_OK((start ? halo_plan_backward_multi_start : halo_plan_backward_multi)(plan, ca, b));
    if (K > 1 && halos && fwd) HALO_OK((start ? halo_plan_halos_forward_multi_start : halo_plan_halos_forward_multi)(plan, ca, b, c));
    if (K > 1 && halos && !fwd) HALO_OK((start ? halo_plan_halos_backward_multi_start : halo_plan_halos_backward_multi)(plan, ca, cb, c));
    if (start) old_finish(plan, dir, form);
}

/* Every form on a plan of K layouts of the given dtypes, padded or
 * halos-only, each held to halo_exchange's bytes. */
static void check_forms(halo_comm_t comm, int K, const int *dtypes, int halos) {
    static layout ls[2];
    int64_t shape[3] = {B, T, C};
    halo_plan_params_t p[2];
    for (int k = 0; k < K; k++) {
        layout *l = &ls[k];
        memset(l, 0, sizeof *l);
        l->dtype = dtypes[k];
        p[k] = params(l->dtype, halos, shape);
        fill(l->x, l->dtype, NX, g_rank + k);
        fill(l->gout, l->dtype, NOUT, g_rank + 11 + k);
        fill(l->gl, l->dtype, NL, g_rank + 5 + k);
        fill(l->gr, l->dtype, NR, g_rank + 9 + k);
        fill(l->gx0, l->dtype, NX, g_rank + 3 + k);
        for (int f = 0; f < NFORMS; f++) {
            memset(l->out[f], 0x7f, sizeof l->out[f]); /* what the exchange must overwrite */
            memset(l->lt[f], 0x7f, sizeof l->lt[f]);
            memset(l->rt[f], 0x7f, sizeof l->rt[f]);
            memcpy(l->gx[f], l->gx0, sizeof l->gx[f]); /* a halos-only backward adds to it */
        }
    }
    halo_plan_t plan;
    if (K == 1) HALO_OK(halo_plan_create(comm, &p[0], &plan));
    else HALO_OK(halo_plan_create_multi(comm, K, p, &plan));
    for (int f = 0; f < NFORMS; f++) {
        run_form(plan, K, halos, HALO_DIR_FORWARD, f, ls);
        run_form(plan, K, halos, HALO_DIR_BACKWARD, f, ls);
    }
    HALO_OK(halo_plan_destroy(plan));
    for (int k = 0; k < K; k++) {
        const layout *l = &ls[k];
        size_t e = esize(l->dtype);
        const char *what = halos ? "halos-only" : "padded";
        /* The reference itself: x is the interior of out. */
        for (int i = 0; !halos && i < B; i++)
            CHECK(!memcmp(l->out[PAIR] + ((size_t)i * (T + L + R) + L) * C * e, l->x + (size_t)i * T * C * e, T * C * e),
                  "halo_exchange: %s forward (layout %d of %d, dtype %d): out's interior is not x", what, k, K, l->dtype);
        for (int f = PAIR + 1; f < NFORMS; f++) {
            int same = halos ? !memcmp(l->lt[f], l->lt[PAIR], NL * e) && !memcmp(l->rt[f], l->rt[PAIR], NR * e)
                             : !memcmp(l->out[f], l->out[PAIR], NOUT * e);
            CHECK(same, "%s%s: %s forward (layout %d of %d, dtype %d) differs from halo_exchange's", form_names[f],
                  K > 1 && f >= OLD ? " (_multi)" : "", what, k, K, l->dtype);
            CHECK(!memcmp(l->gx[f], l->gx[PAIR], NX * e), "%s%s: %s backward (layout %d of %d, dtype %d) differs from halo_exchange's",
                  form_names[f], K > 1 && f >= OLD ? " (_multi)" : "", what, k, K, l->dtype);
        }
    }
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
    EXPECT(halo_exchange(plan, HALO_DIR_FORWARD, bufs, 3, NULL), HALO_ERR_INVALID_ARGUMENT, "use forward and backward");
    EXPECT(halo_exchange(plan, HALO_DIR_FORWARD, bufs, 1, NULL), HALO_ERR_INVALID_ARGUMENT, "count is 1 but this plan's exchange takes 2 buffers");
    EXPECT(halo_exchange(plan, HALO_DIR_BACKWARD, NULL, 2, NULL), HALO_ERR_INVALID_ARGUMENT, "buffers is NULL");
    EXPECT(halo_exchange(plan, (halo_direction_t)7, bufs, 2, NULL), HALO_ERR_INVALID_ARGUMENT, "direction 7");
    EXPECT(halo_exchange(NULL, HALO_DIR_FORWARD, bufs, 2, NULL), HALO_ERR_INVALID_HANDLE, "NULL");
    void *nulls[2] = {x, NULL};
    EXPECT(halo_exchange(plan, HALO_DIR_FORWARD, nulls, 2, NULL), HALO_ERR_INVALID_ARGUMENT, "out is NULL");
    if (!g_stream && access("/dev/nvidiactl", F_OK) != 0)
        EXPECT(halo_exchange(plan, HALO_DIR_FORWARD, bufs, 2, S1), HALO_ERR_INVALID_ARGUMENT, "libcuda.so.1");
    int done;
    EXPECT(halo_request_test(NULL, &done), HALO_ERR_INVALID_HANDLE, "request handle is NULL");
    EXPECT(halo_request_wait((halo_request_t)(void *)plan, NULL), HALO_ERR_INVALID_HANDLE, "a plan handle");
    EXPECT(halo_request_free((halo_request_t)(uintptr_t)0x1234), HALO_ERR_INVALID_HANDLE, "not a halo handle");
    if (!g_stream && access("/dev/nvidiactl", F_OK) != 0) /* no GPU here: the driver cannot load */
        EXPECT(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 2, S1, &req), HALO_ERR_INVALID_ARGUMENT, "libcuda.so.1");

    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 2, g_stream ? S1 : NULL, &req));
    if (!g_stream) EXPECT(halo_request_wait(req, S2), HALO_ERR_INVALID_ARGUMENT, "without a stream");
    HALO_OK(halo_request_wait(req, NULL));
    HALO_OK(halo_request_free(req));
    EXPECT(halo_request_free(req), HALO_ERR_INVALID_HANDLE, "not live");

    /* Freeing a request that cannot end yet (rank 1 starts late) releases
     * it when it ends, as ucp_request_free: the handle goes at once, and the
     * exchange still ends, before the next blocking call on the host (or, on
     * a stream, ahead of the next exchange there). */
    float ref[NOUT], again[NOUT];
    memcpy(ref, out, sizeof ref);
    void *b2[2] = {x, again};
    for (int k = 0; k < (g_stream ? 2 : 1); k++) {
        memset(out, 0x7f, sizeof out);
        memset(again, 0x7f, sizeof again);
        if (g_rank == 1) usleep(300 * 1000);
        HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, bufs, 2, g_stream ? S1 : NULL, &req));
        if (k == 1) HALO_OK(halo_request_wait(req, S2)); /* a stream waits for it, the host never does */
        HALO_OK(halo_request_free(req));
        EXPECT(halo_request_wait(req, NULL), HALO_ERR_INVALID_HANDLE, "not live");
        HALO_OK(halo_exchange(plan, HALO_DIR_FORWARD, b2, 2, g_stream ? (k ? S2 : S1) : NULL));
        CHECK(!memcmp(out, ref, sizeof out), "the exchange of a request freed early did not end with the forward's result (%d)", k);
        CHECK(!memcmp(again, ref, sizeof again), "the exchange after a request freed early differs (%d)", k);
    }
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
    float x[NX], out[NOUT], gx[NX], out2[NOUT];
    fill(x, HALO_FLOAT32, NX, 0);
    void *f[2] = {x, out}, *b[2] = {out, gx}, *f2[2] = {x, out2};
    halo_request_t a, q, z;
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f, 2, S1, &a));
    HALO_OK(halo_exchange_start(plan, HALO_DIR_BACKWARD, b, 2, S2, &q));
    /* A third, freed once a stream was told to wait for it (NCCL's way):
     * its failure is reported by the next exchange, once. */
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f2, 2, S1, &z));
    HALO_OK(halo_request_wait(z, S2));
    HALO_OK(halo_request_free(z));
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
    rc = halo_exchange(plan, HALO_DIR_FORWARD, f, 2, NULL);
    CHECK(rc == HALO_ERR_COMM_FAILED && strstr(halo_last_error(), "freed before its result was read"),
          "the exchange after a freed request's failure: %s: %s", halo_strerror(rc), halo_last_error());
    rc = halo_exchange(plan, HALO_DIR_FORWARD, f, 2, NULL);
    CHECK(rc == HALO_ERR_COMM_FAILED && !strstr(halo_last_error(), "freed before"),
          "a freed request's failure was reported twice: %s: %s", halo_strerror(rc), halo_last_error());
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

/* Finding: a stream handle below 4096 (CU_STREAM_LEGACY is 0x1) given to
 * Go as a pointer type made the garbage collector abort the process ("bad
 * pointer in frame ... invalid pointer found on stack"). Small handles,
 * many calls, GOGC=1 so that stacks are scanned all the time. */
static int small_streams_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[8], out[8 + L + R];
    fill(x, HALO_FLOAT32, 8, g_rank);
    void *f[2] = {x, out};
    for (int i = 0; i < 3000; i++) {
        void *s = (void *)(uintptr_t)(1 + i % 8), *other = (void *)(uintptr_t)(1 + (i + 1) % 8);
        halo_request_t req;
        HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f, 2, s, &req));
        if (i % 2) HALO_OK(halo_request_wait(req, other));
        HALO_OK(halo_request_wait(req, NULL));
        HALO_OK(halo_request_free(req));
    }
    HALO_OK(halo_plan_destroy(plan));
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --small-streams: rank %d of %d: %d failures\n", g_rank, g_world, g_failures);
    return g_failures ? 1 : 0;
}

enum { NQ = 3000 };
static halo_request_t g_reqs[NQ];

/* Checks rank 0's right halo and rank 1's left one against the peer's x. */
static void check_1d(const float *out, int n, int seed_of_peer, const char *what) {
    float peer[16];
    fill(peer, HALO_FLOAT32, n, seed_of_peer);
    const float *got = g_rank == 0 ? out + L + n : out;
    const float *exp = g_rank == 0 ? peer : peer + n - L;
    CHECK(!memcmp(got, exp, (g_rank == 0 ? R : L) * sizeof(float)), "%s: the halo from rank %d is wrong", what, 1 - g_rank);
}

/* Finding: the proxy called the driver under the lock its thread needs to
 * pop jobs; with a full stream (the host emulation holds 1024 operations,
 * two per start) about 512 starts deadlocked for ever. */
static int queue_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[8], out[8 + L + R];
    fill(x, HALO_FLOAT32, 8, g_rank);
    void *f[2] = {x, out};
    for (int streams = 1; streams <= 4; streams += 3) {
        double t0 = now_s();
        memset(out, 0x7f, sizeof out);
        for (int i = 0; i < NQ; i++)
            HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f, 2, (void *)(uintptr_t)(0x60 + i % streams), &g_reqs[i]));
        for (int i = 0; i < NQ; i++) {
            HALO_OK(halo_request_wait(g_reqs[i], NULL));
            HALO_OK(halo_request_free(g_reqs[i]));
        }
        check_1d(out, 8, 1 - g_rank, streams == 1 ? "one stream" : "four streams");
        printf("rank %d: %d exchanges queued on %d stream(s): %.2f s\n", g_rank, NQ, streams, now_s() - t0);
    }
    HALO_OK(halo_plan_destroy(plan));
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --queue: rank %d: %d failures\n", g_rank, g_failures);
    return g_failures ? 1 : 0;
}

static double g_aborted_at;
static void *abort_later(void *arg) {
    usleep(300 * 1000);
    g_aborted_at = now_s();
    halo_comm_abort((halo_comm_t)arg);
    return NULL;
}

/* Rank 1 never exchanges, so rank 0's first exchange holds its stream and
 * the starts behind it fill the stream's queue until one blocks; the abort
 * must end that start (COMM_FAILED) and every request, within a second. */
static int queue_abort_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[8], out[8 + L + R];
    fill(x, HALO_FLOAT32, 8, g_rank);
    HALO_OK(halo_plan_forward(plan, x, out)); /* both are through the plan's creation */
    if (g_rank != 0) {
        sleep(3); /* alive, never exchanging again */
        halo_comm_destroy(c);
        return 0;
    }
    void *f[2] = {x, out};
    pthread_t t;
    pthread_create(&t, NULL, abort_later, c);
    int started = 0, refused = 0;
    for (int i = 0; i < NQ; i++) {
        halo_result_t rc = halo_exchange_start(plan, HALO_DIR_FORWARD, f, 2, (void *)(uintptr_t)(0x60 + i % 2), &g_reqs[started]);
        if (rc == HALO_SUCCESS) {
            started++;
            continue;
        }
        CHECK(rc == HALO_ERR_COMM_FAILED, "start %d after abort: %s: %s", i, halo_strerror(rc), halo_last_error());
        refused++;
    }
    double ended_starts = now_s();
    pthread_join(t, NULL);
    CHECK(refused > 0 && started >= 512, "%d started, %d refused: the stream's queue never filled before the abort", started, refused);
    for (int i = 0; i < started; i++) {
        halo_result_t rc = halo_request_wait(g_reqs[i], NULL);
        CHECK(rc == HALO_ERR_COMM_FAILED, "request %d after abort: %s: %s", i, halo_strerror(rc), halo_last_error());
        HALO_OK(halo_request_free(g_reqs[i]));
    }
    double took = now_s() - g_aborted_at;
    CHECK(took < 1.0, "the abort took %.2f s to end the starts (%.2f s) and the requests", took, ended_starts - g_aborted_at);
    printf("rank 0: %d started, %d refused, all ended %.3f s after the abort\n", started, refused, took);
    halo_plan_destroy(plan);
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --queue-abort: rank 0: %d failures\n", g_failures);
    return g_failures ? 1 : 0;
}

/* Finding: a request outlived its communicator; a stream told to wait on
 * it would read the flag the destroy freed. Both kinds, one rank. */
static int destroyed_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[8], out[8 + L + R], gx[8];
    fill(x, HALO_FLOAT32, 8, 0);
    void *f[2] = {x, out}, *b[2] = {out, gx};
    halo_request_t done_stream, host;
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f, 2, S1, &done_stream));
    HALO_OK(halo_request_wait(done_stream, NULL));
    HALO_OK(halo_exchange_start(plan, HALO_DIR_BACKWARD, b, 2, NULL, &host)); /* in flight */
    halo_result_t rc = halo_comm_destroy(c); /* cancels the one in flight, and says so */
    CHECK(rc == HALO_ERR_INVALID_STATE, "destroy with a host exchange in flight: %s: %s", halo_strerror(rc), halo_last_error());
    int done = 0;
    EXPECT(halo_request_wait(done_stream, S2), HALO_ERR_INVALID_STATE, "halo_comm_destroy");
    EXPECT(halo_request_wait(done_stream, NULL), HALO_ERR_INVALID_STATE, "halo_comm_destroy");
    EXPECT(halo_request_test(done_stream, &done), HALO_ERR_INVALID_STATE, "halo_comm_destroy");
    EXPECT(halo_request_wait(host, NULL), HALO_ERR_INVALID_STATE, "halo_comm_destroy");
    EXPECT(halo_request_test(host, &done), HALO_ERR_INVALID_STATE, "halo_comm_destroy");
    HALO_OK(halo_request_free(done_stream));
    HALO_OK(halo_request_free(host));
    printf("test_request --destroyed: %d failures\n", g_failures);
    return g_failures ? 1 : 0;
}

/* Finding: halo_plan_wait finished an exchange a request had started; the
 * request's wait then finished the next request's exchange. */
static int owner_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[2][8], out[2][8 + L + R];
    void *f[2][2];
    for (int k = 0; k < 2; k++) {
        fill(x[k], HALO_FLOAT32, 8, g_rank + 2 * k);
        memset(out[k], 0x7f, sizeof out[k]);
        f[k][0] = x[k];
        f[k][1] = out[k];
    }
    halo_request_t first, second;
    int done = 0;
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f[0], 2, NULL, &first));
    EXPECT(halo_plan_wait(plan, HALO_DIR_FORWARD), HALO_ERR_INVALID_STATE, "halo_request_wait");
    EXPECT(halo_plan_test(plan, HALO_DIR_FORWARD, &done), HALO_ERR_INVALID_STATE, "belongs to a request");
    HALO_OK(halo_request_wait(first, NULL));
    check_1d(out[0], 8, 1 - g_rank, "the first request");
    HALO_OK(halo_exchange_start(plan, HALO_DIR_FORWARD, f[1], 2, NULL, &second));
    HALO_OK(halo_request_wait(first, NULL)); /* ended: says so again, touches nothing */
    EXPECT(halo_plan_wait(plan, HALO_DIR_FORWARD), HALO_ERR_INVALID_STATE, "belongs to a request");
    HALO_OK(halo_request_test(second, &done));
    HALO_OK(halo_request_wait(second, NULL));
    check_1d(out[1], 8, 1 - g_rank + 2, "the second request");
    HALO_OK(halo_request_free(first));
    HALO_OK(halo_request_free(second));
    /* The 0.3 calls keep working on their own exchanges. */
    HALO_OK(halo_plan_forward_start(plan, x[0], out[0]));
    HALO_OK(halo_plan_wait(plan, HALO_DIR_FORWARD));
    HALO_OK(halo_plan_destroy(plan));
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --owner: rank %d: %d failures\n", g_rank, g_failures);
    return g_failures ? 1 : 0;
}

/* Finding: after an abort, halo_plan_test said COMM_FAILED and then
 * halo_plan_wait said INVALID_STATE ("no forward in flight"). */
static int abort_plan_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[8], out[8 + L + R];
    fill(x, HALO_FLOAT32, 8, g_rank);
    HALO_OK(halo_plan_forward(plan, x, out)); /* both are through the plan's creation */
    if (g_rank != 0) {
        sleep(1); /* alive, never exchanging again */
        halo_comm_destroy(c);
        return 0;
    }
    /* The abort voids what rank 1 has not received yet: let its forward end. */
    usleep(300 * 1000);
    HALO_OK(halo_plan_forward_start(plan, x, out));
    HALO_OK(halo_comm_abort(c));
    int done = 0;
    EXPECT(halo_plan_test(plan, HALO_DIR_FORWARD, &done), HALO_ERR_COMM_FAILED, "abort");
    EXPECT(halo_plan_wait(plan, HALO_DIR_FORWARD), HALO_ERR_COMM_FAILED, "abort");
    EXPECT(halo_plan_wait(plan, HALO_DIR_BACKWARD), HALO_ERR_COMM_FAILED, "abort");
    halo_plan_destroy(plan);
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --abort-plan: rank 0: %d failures\n", g_failures);
    return g_failures ? 1 : 0;
}

/* Finding: a forked child that destroyed the communicator it inherited
 * (an atexit handler does) told the peers this rank was gone; and a child
 * that enters Go can hang on a lock another thread held at the fork. A
 * communicator belongs to the process that made it: in a child, destroy
 * only forgets it and every other call is refused at once. */
static int fork_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[1] = {8};
    halo_plan_params_t p = plan_1d(shape, L, R);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[8], out[8 + L + R];
    fill(x, HALO_FLOAT32, 8, g_rank);
    HALO_OK(halo_plan_forward(plan, x, out));
    if (g_rank == 0) {
        pid_t child = fork();
        if (child == 0) {
            /* Refused at once, saying why; destroy only forgets. */
            if (halo_plan_forward(plan, x, out) != HALO_ERR_INVALID_STATE || !strstr(halo_last_error(), "forked from process"))
                _exit(4);
            if (halo_plan_destroy(plan) != HALO_SUCCESS) _exit(5);
            int rc = halo_comm_destroy(c);
            _exit(rc == HALO_SUCCESS ? 0 : 3);
        }
        int status = 0;
        double until = now_s() + 10;
        while (waitpid(child, &status, WNOHANG) == 0) {
            if (now_s() > until) {
                kill(child, SIGKILL);
                waitpid(child, &status, 0);
                CHECK(0, "the forked child's halo_comm_destroy hung");
                break;
            }
            usleep(10000);
        }
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's destroy failed (status %#x)", status);
    } else {
        usleep(500 * 1000); /* after the child's destroy */
    }
    memset(out, 0x7f, sizeof out);
    halo_result_t rc = halo_plan_forward(plan, x, out);
    CHECK(rc == HALO_SUCCESS, "exchange after the fork: %s: %s", halo_strerror(rc), halo_last_error());
    if (rc == HALO_SUCCESS) check_1d(out, 8, 1 - g_rank, "after the fork");
    HALO_OK(halo_plan_destroy(plan));
    HALO_OK(halo_comm_destroy(c));
    printf("test_request --fork: rank %d: %d failures\n", g_rank, g_failures);
    return g_failures ? 1 : 0;
}

static int rank_main(int port) {
    halo_comm_t c = make_comm(port, 20000);
    static const int one[2][1] = {{HALO_FLOAT32}, {HALO_BFLOAT16}}, two[2] = {HALO_FLOAT32, HALO_BFLOAT16};
    for (int halos = 0; halos < 2; halos++) {
        check_forms(c, 1, one[0], halos);
        check_forms(c, 1, one[1], halos);
        check_forms(c, 2, two, halos);
    }
    check_bad_input(c);
    HALO_OK(halo_comm_destroy(c));
    printf("test_request: rank %d: %d failures\n", g_rank, g_failures);
    return g_failures ? 1 : 0;
}

static const struct mode {
    const char *flag;
    int (*main)(int port);
    int world;
} modes[] = {
    {"--abort", abort_main, 2},         {"--order", order_main, 2},       {"--small-streams", small_streams_main, 2},
    {"--queue", queue_main, 2},         {"--queue-abort", queue_abort_main, 2}, {"--destroyed", destroyed_main, 1},
    {"--owner", owner_main, 2},         {"--abort-plan", abort_plan_main, 2},   {"--fork", fork_main, 2},
};

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_stream = has_flag(argc, argv, "--stream");
    const struct mode *m = NULL;
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++)
        if (has_flag(argc, argv, modes[i].flag)) m = &modes[i];
    halo_comm_params_t unused = HALO_COMM_PARAMS_INITIALIZER;
    (void)unused;
    if (rank_args(argc, argv, &port)) return m ? m->main(port) : rank_main(port);
    int bad;
    if (m && m->main == small_streams_main) {
        /* The collector as often as it goes, on one rank and on two. */
        setenv("GOGC", "1", 1);
        char *extra[1] = {(char *)m->flag};
        bad = launch(argv[0], 1, 60, NULL, 1, extra) + launch(argv[0], 2, 60, NULL, 1, extra);
    } else if (m) {
        char *extra[1] = {(char *)m->flag};
        bad = launch(argv[0], m->world, m->main == queue_main || m->main == queue_abort_main ? 30 : 60, NULL, 1, extra);
    } else {
        char *extra[1] = {"--stream"};
        bad = launch(argv[0], 3, 90, NULL, g_stream, extra);
    }
    printf("test_request%s%s: %s\n", m || g_stream ? " " : "", m ? m->flag : g_stream ? "--stream" : "", bad ? "FAILED" : "passed");
    return bad ? 1 : 0;
}
