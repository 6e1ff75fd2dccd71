/* Bad input through the C ABI: every validated argument returns its code and
 * a message that says what was wrong; ranks that disagree all fail; a peer
 * killed with SIGKILL makes the survivor fail within its deadline.
 *
 *   test_errors args        single process: argument validation
 *   test_errors mismatch    3 ranks, rank 2 disagrees on the dtype, rank 1 on
 *                           the padding mode
 *   test_errors kill        2 ranks, rank 1 dies during an exchange
 *   test_errors kill_prompt the same with a 30 s deadline and default settings:
 *                           rank 0 must get PEER_FAILED naming rank 1 within
 *                           3 s (the kernel closes the dead rank's liveness
 *                           link), not a TIMEOUT at the deadline
 *   test_errors async       2 ranks: misuse of start/test/wait, destroy with an
 *                           exchange in flight
 *   test_errors async_kill  3 ranks, rank 1 dies while the others have an
 *                           exchange in flight: their waits fail in the deadline
 *   test_errors async_kill_prompt  the same with a 30 s deadline: PEER_FAILED
 *                           naming rank 1 within 3 s
 *   test_errors abort       2 ranks, rank 0 blocked in an exchange that rank 1
 *                           never joins; another thread aborts the communicator */
#include <pthread.h>

#include "launch.h"

/* Whether "a: b" starts with the same words twice ("x: x: ..."),
 * as it would if the library's message repeated halo_strerror's. */
static int repeats_prefix(const char *a, const char *b) {
    size_t n = strlen(a);
    return !strncmp(a, b, n) && (b[n] == ':' || b[n] == '\0');
}

static void expect(halo_result_t got, halo_result_t want, const char *needle, const char *what) {
    const char *msg = halo_last_error();
    CHECK(got == want, "%s: got %s, want %s (%s)", what, halo_strerror(got), halo_strerror(want), msg);
    if (got == want && needle) CHECK(strstr(msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg, needle);
    /* Callers print "strerror: last_error" (docs/cpp.md): one prefix, once. */
    CHECK(!repeats_prefix(halo_strerror(got), msg), "%s: \"%s: %s\" repeats its prefix", what, halo_strerror(got), msg);
}

static halo_plan_params_t params(int64_t *shape) {
    halo_plan_params_t p;
    memset(&p, 0, sizeof p);
    p.dtype = HALO_FLOAT32;
    p.ndim = 2;
    p.shape = shape;
    p.dim = 1;
    p.left = 1;
    p.right = 1;
    return p;
}

static int test_args(void) {
    g_rank = 0;
    CHECK(halo_version_number() == HALO_VERSION_NUMBER, "library %d vs header %d", halo_version_number(), HALO_VERSION_NUMBER);
    CHECK(!strcmp(halo_version_string(), HALO_VERSION_STRING), "version string %s", halo_version_string());
    CHECK(!strcmp(halo_strerror(HALO_ERR_TIMEOUT), "timed out"), "strerror");
    CHECK(!strcmp(halo_strerror((halo_result_t)999), "unknown result code"), "strerror of unknown code");

    halo_comm_t c = NULL;
    expect(halo_comm_create(0, 1, NULL, NULL), HALO_ERR_INVALID_ARGUMENT, "comm (the output pointer) is NULL", "NULL comm out");
    expect(halo_comm_create(2, 2, NULL, &c), HALO_ERR_INVALID_ARGUMENT, "rank 2 is out of range for world size 2", "rank >= world");
    expect(halo_comm_create(-1, 2, NULL, &c), HALO_ERR_INVALID_ARGUMENT, "rank -1 is out of range", "negative rank");
    expect(halo_comm_create(0, 0, NULL, &c), HALO_ERR_INVALID_ARGUMENT, "world size 0 is out of range", "world 0");
    CHECK(c == NULL, "output written on failure");
    halo_comm_params_t cp;
    memset(&cp, 0, sizeof cp);
    cp.field_mask = HALO_COMM_PARAM_RENDEZVOUS;
    expect(halo_comm_create(0, 2, &cp, &c), HALO_ERR_INVALID_ARGUMENT, "params->rendezvous is NULL", "NULL rendezvous");
    cp.rendezvous = "no-port-here";
    expect(halo_comm_create(0, 2, &cp, &c), HALO_ERR_INVALID_ARGUMENT, "rendezvous address \"no-port-here\"", "bad address");
    cp.rendezvous = "192.0.2.1:29600";
    expect(halo_comm_create(0, 2, &cp, &c), HALO_ERR_INVALID_ARGUMENT, "token is required", "non-loopback without token");
    cp.field_mask = HALO_COMM_PARAM_TIMEOUT;
    cp.timeout_ms = -5;
    expect(halo_comm_create(0, 1, &cp, &c), HALO_ERR_INVALID_ARGUMENT, "timeout_ms = -5 ms is out of range", "negative timeout");
    cp.field_mask = 1u << 30;
    expect(halo_comm_create(0, 1, &cp, &c), HALO_ERR_INVALID_ARGUMENT, "unknown bits 0x40000000", "unknown mask bits");
    cp.field_mask = HALO_COMM_PARAM_BOOTSTRAP;
    cp.bootstrap = (halo_bootstrap_t)7;
    expect(halo_comm_create(0, 1, &cp, &c), HALO_ERR_INVALID_ARGUMENT, "unknown bootstrap 7", "bad bootstrap");

    /* Nobody hosts the rendezvous rank 1 looks for: it fails, within the
     * bootstrap deadline, saying where it looked. */
    cp.field_mask = HALO_COMM_PARAM_RENDEZVOUS | HALO_COMM_PARAM_BOOTSTRAP_TIMEOUT;
    cp.rendezvous = "127.0.0.1:1";
    cp.bootstrap_timeout_ms = 300;
    expect(halo_comm_create(1, 2, &cp, &c), HALO_ERR_RENDEZVOUS, "127.0.0.1:1", "no rendezvous");

    HALO_OK(halo_comm_create(0, 1, NULL, &c)); /* world of one: no rendezvous */
    int rank = -1, world = -1;
    HALO_OK(halo_comm_get_rank(c, &rank, &world));
    CHECK(rank == 0 && world == 1, "rank %d world %d", rank, world);
    const void *addr;
    size_t alen;
    HALO_OK(halo_comm_get_address(c, &addr, &alen));
    CHECK(alen > 0, "empty address");
    expect(halo_comm_connect(c, &addr, &alen), HALO_ERR_INVALID_STATE, "already connected", "connect twice");
    expect(halo_comm_get_rank(NULL, &rank, &world), HALO_ERR_INVALID_HANDLE, "communicator handle is NULL", "NULL comm");

    int64_t shape[8] = {3, 4, 1, 1, 1, 1, 1, 1};
    halo_plan_params_t p = params(shape);
    halo_plan_t plan = NULL;
    expect(halo_plan_create(c, NULL, &plan), HALO_ERR_INVALID_ARGUMENT, "params or plan", "NULL params");
    expect(halo_plan_create(c, &p, NULL), HALO_ERR_INVALID_ARGUMENT, "params or plan", "NULL plan out");
    p.ndim = 0;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "ndim 0 is out of range", "ndim 0");
    p.ndim = 9;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "ndim 9 is out of range", "ndim 9");
    p = params(shape);
    p.dim = 2;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "dim 2 is out of range for a 2-d tensor", "dim out of range");
    p = params(shape);
    p.left = -1;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "must not be negative (left -1, right 1)", "negative left");
    p = params(shape);
    p.dtype = (halo_dtype_t)42;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "unknown dtype 42", "bad dtype");
    p = params(shape);
    p.shape = NULL;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "params->shape is NULL", "NULL shape");
    int64_t huge[2] = {INT64_C(1) << 40, INT64_C(1) << 30};
    p = params(huge);
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "overflows", "overflowing shape");
    int64_t negshape[2] = {3, -4};
    p = params(negshape);
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "shape[1] = -4 is negative", "negative shape");
    p = params(shape);
    p.field_mask = HALO_PLAN_PARAM_X_STRIDES;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "params->x_strides is NULL", "NULL strides");
    int64_t overlap[2] = {1, 1};
    p.field_mask = HALO_PLAN_PARAM_OUT_STRIDES;
    p.out_strides = overlap;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "overlap in memory", "overlapping out strides");
    p = params(shape);
    p.field_mask = 1u << 20;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "unknown bits", "unknown plan mask bits");
    p = params(shape);
    p.field_mask = HALO_PLAN_PARAM_PADDING;
    p.padding = (halo_padding_t)7;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "unknown padding 7", "bad padding");
    CHECK(plan == NULL, "plan output written on failure");
    /* halos the global length (4 here) cannot serve, by torch's rules */
    p.padding = HALO_PAD_REFLECT;
    p.left = 4;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT,
           "reflect padding needs halos shorter than the sequence: left halo 4, right halo 1, global length 4 along dim 1", "reflect halo");
    p.padding = HALO_PAD_CIRCULAR;
    p.left = 5;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT,
           "circular padding needs halos no longer than the sequence: left halo 5, right halo 1, global length 4", "circular halo");
    CHECK(plan == NULL, "plan output written on failure");
    /* a rank its own neighbour: circular wraps around its own shard */
    p.left = 1;
    HALO_OK(halo_plan_create(c, &p, &plan));
    {
        float x[12], out[18];
        for (int i = 0; i < 12; i++) x[i] = (float)i;
        HALO_OK(halo_plan_forward(plan, x, out));
        CHECK(out[0] == 3 && out[1] == 0 && out[4] == 3 && out[5] == 0 && out[6] == 7 && out[11] == 4, "W=1 circular output wrong");
    }
    HALO_OK(halo_plan_destroy(plan));

    /* Memory types: what the transport moves, and CUDA plans. */
    plan = NULL;
    uint64_t types = 0;
    expect(halo_comm_memory_types(NULL, &types), HALO_ERR_INVALID_HANDLE, "communicator handle is NULL", "memory types of NULL");
    expect(halo_comm_memory_types(c, NULL), HALO_ERR_INVALID_ARGUMENT, "types (the output pointer) is NULL", "NULL types");
    HALO_OK(halo_comm_memory_types(c, &types));
    CHECK(types & (1u << HALO_MEMORY_HOST), "memory types %#llx lack host", (unsigned long long)types);
    p = params(shape);
    p.field_mask = HALO_PLAN_PARAM_MEMORY_TYPE;
    p.memory_type = HALO_MEMORY_CUDA;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "must be halos-only", "padded CUDA plan");
    p.field_mask |= HALO_PLAN_PARAM_HALOS_ONLY;
    p.halos_only = 1;
    if (types & (1u << HALO_MEMORY_CUDA)) {
        printf("  (this UCX moves CUDA memory: no refusal to check)\n");
    } else {
        expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "--with-cuda", "CUDA plan without CUDA in UCX");
    }
    p.memory_type = (halo_memory_type_t)4;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "unknown memory type 4", "bad memory type");
    CHECK(plan == NULL, "plan output written on failure");

    p = params(shape);
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[12], out[18];
    for (int i = 0; i < 12; i++) x[i] = (float)i;
    expect(halo_plan_forward(plan, NULL, out), HALO_ERR_INVALID_ARGUMENT, "x is NULL", "NULL x");
    expect(halo_plan_forward(plan, x, NULL), HALO_ERR_INVALID_ARGUMENT, "out is NULL", "NULL out");
    expect(halo_plan_backward(plan, NULL, x), HALO_ERR_INVALID_ARGUMENT, "grad_out is NULL", "NULL grad_out");
    expect(halo_plan_forward(plan, out + 2, out), HALO_ERR_INVALID_ARGUMENT, "x overlaps out but is not its interior", "partial overlap");
    HALO_OK(halo_plan_forward(plan, x, out));
    /* world of one: halos are zero padding */
    CHECK(out[0] == 0 && out[1] == 0 && out[5] == 0 && out[6] == 0 && out[7] == 4 && out[17] == 0, "W=1 output wrong");

    /* foreign and stale handles */
    expect(halo_plan_forward((halo_plan_t)c, x, out), HALO_ERR_INVALID_HANDLE, "is a communicator handle, not a live plan", "comm as plan");
    expect(halo_comm_destroy((halo_comm_t)plan), HALO_ERR_INVALID_HANDLE, "is a plan handle, not a live communicator", "plan as comm");
    expect(halo_plan_forward((halo_plan_t)(uintptr_t)0x1234, x, out), HALO_ERR_INVALID_HANDLE, "not a halo handle", "garbage handle");
    HALO_OK(halo_plan_destroy(plan));
    expect(halo_plan_destroy(plan), HALO_ERR_INVALID_HANDLE, "not live (already destroyed?)", "plan destroyed twice");
    expect(halo_plan_forward(plan, x, out), HALO_ERR_INVALID_HANDLE, "not live", "stale plan");
    HALO_OK(halo_plan_create(c, &p, &plan));
    HALO_OK(halo_comm_destroy(c)); /* destroys the plan too */
    expect(halo_plan_forward(plan, x, out), HALO_ERR_INVALID_HANDLE, "not live", "plan of destroyed comm");
    expect(halo_comm_destroy(c), HALO_ERR_INVALID_HANDLE, "not live", "comm destroyed twice");
    printf("test_errors args: %d failures\n", g_failures);
    return g_failures ? 1 : 0;
}

static int rank_mismatch(int port) {
    halo_comm_t c = make_comm(port, 20000);
    int64_t shape[2] = {3, 4};
    halo_plan_params_t p = params(shape);
    if (g_rank == 2) p.dtype = HALO_FLOAT16;
    halo_plan_t plan = NULL;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_MISMATCH, "dtype: float32 on ranks 0-1, float16 on rank 2", "mismatch");
    p.dtype = HALO_FLOAT32;
    p.field_mask = HALO_PLAN_PARAM_PADDING;
    p.padding = g_rank == 1 ? HALO_PAD_CIRCULAR : HALO_PAD_REFLECT;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_MISMATCH, "padding: reflect on ranks 0, 2, circular on rank 1", "padding mismatch");
    p = params(shape);
    /* the communicator stays usable after a mismatch */
    p.dtype = HALO_FLOAT32;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[12] = {0}, out[18];
    HALO_OK(halo_plan_forward(plan, x, out));
    HALO_OK(halo_comm_destroy(c));
    return g_failures ? 1 : 0;
}

static int rank_kill(int port, int prompt) {
    /* prompt: a deadline far beyond the 3 s allowed, so that only finding
     * the death (not the deadline) can pass */
    const int64_t timeout_ms = prompt ? 30000 : 3000;
    halo_comm_t c = make_comm(port, timeout_ms);
    int64_t shape[2] = {64, 256};
    halo_plan_params_t p = params(shape);
    p.dim = 0;
    p.left = p.right = 2;
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    static float x[64 * 256], out[68 * 256];
    HALO_OK(halo_plan_forward(plan, x, out));
    if (g_rank == 1) raise(SIGKILL); /* dies with the next exchange pending on rank 0 */
    double t0 = now_s();
    halo_result_t rc = halo_plan_forward(plan, x, out);
    double took = now_s() - t0;
    halo_result_t first = rc;
    char first_msg[512];
    snprintf(first_msg, sizeof first_msg, "%s", halo_last_error());
    CHECK(rc == HALO_ERR_TIMEOUT || rc == HALO_ERR_PEER_FAILED, "forward with a dead peer returned %s: %s", halo_strerror(rc), halo_last_error());
    CHECK(strstr(halo_last_error(), "rank 1") != NULL, "message does not name rank 1: %s", halo_last_error());
    CHECK(took < timeout_ms / 1000.0 + 2.0, "took %.2f s for a %ld ms deadline", took, (long)timeout_ms);
    if (prompt) {
        CHECK(rc == HALO_ERR_PEER_FAILED, "forward with a killed peer returned %s, want PEER_FAILED: %s", halo_strerror(rc), halo_last_error());
        CHECK(took < 3.0, "the killed peer was found after %.2f s (deadline %ld ms), want < 3 s", took, (long)timeout_ms);
    }
    rc = halo_plan_forward(plan, x, out);
    CHECK(rc == HALO_ERR_COMM_FAILED, "after a failure: %s: %s", halo_strerror(rc), halo_last_error());
    t0 = now_s();
    HALO_OK(halo_comm_destroy(c));
    CHECK(now_s() - t0 < 5.0, "destroy took %.2f s", now_s() - t0);
    printf("test_errors kill: rank 0 saw %s after %.2f s: %s\n", halo_strerror(first), took, first_msg);
    return g_failures ? 1 : 0;
}

static int rank_async(int port) {
    halo_comm_t c = make_comm(port, 10000);
    int64_t shape[2] = {8, 32};
    halo_plan_params_t p = params(shape);
    p.dim = 0;
    halo_plan_t plan, doomed;
    HALO_OK(halo_plan_create(c, &p, &plan));
    HALO_OK(halo_plan_create(c, &p, &doomed));
    static float x[8 * 32], out[10 * 32], gx[8 * 32], left[32], right[32];
    int done = 0;
    expect(halo_plan_wait(plan, HALO_DIR_FORWARD), HALO_ERR_INVALID_STATE, "no forward of plan 1 is in flight", "wait without start");
    expect(halo_plan_test(plan, HALO_DIR_BACKWARD, &done), HALO_ERR_INVALID_STATE, "no backward of plan 1 is in flight", "test without start");
    expect(halo_plan_wait(plan, (halo_direction_t)7), HALO_ERR_INVALID_ARGUMENT, "direction 7", "bad direction");
    expect(halo_plan_halos_forward(plan, x, left, right), HALO_ERR_INVALID_ARGUMENT, "use forward and backward", "halos call on a padded plan");
    HALO_OK(halo_plan_forward_start(plan, x, out));
    expect(halo_plan_forward_start(plan, x, out), HALO_ERR_INVALID_STATE, "already in flight", "second start");
    expect(halo_plan_forward(plan, x, out), HALO_ERR_INVALID_STATE, "already in flight", "blocking call while started");
    expect(halo_plan_test(plan, HALO_DIR_FORWARD, NULL), HALO_ERR_INVALID_ARGUMENT, "done", "test with NULL done");
    /* the other direction is independent, and so is the other plan */
    HALO_OK(halo_plan_backward(plan, out, gx));
    HALO_OK(halo_plan_forward(doomed, x, out));
    while (!done) HALO_OK(halo_plan_test(plan, HALO_DIR_FORWARD, &done));
    /* destroying a plan mid-exchange cancels it and fails the communicator,
     * on the rank that did it; the peer's exchange then fails too */
    HALO_OK(halo_plan_forward_start(doomed, x, out));
    if (g_rank == 0) {
        expect(halo_plan_destroy(doomed), HALO_ERR_INVALID_STATE, "destroyed while a forward was in flight", "destroy in flight");
        expect(halo_plan_forward(plan, x, out), HALO_ERR_COMM_FAILED, NULL, "after a cancelled exchange");
    } else {
        halo_result_t rc = halo_plan_wait(doomed, HALO_DIR_FORWARD);
        /* rank 0 may have sent before cancelling: success or a clean failure */
        CHECK(rc == HALO_SUCCESS || rc == HALO_ERR_TIMEOUT || rc == HALO_ERR_PEER_FAILED, "peer of a cancelled exchange: %s: %s",
              halo_strerror(rc), halo_last_error());
    }
    double t0 = now_s();
    HALO_OK(halo_comm_destroy(c));
    CHECK(now_s() - t0 < 5.0, "destroy took %.2f s", now_s() - t0);
    return g_failures ? 1 : 0;
}

static int rank_async_kill(int port, int prompt) {
    const int64_t timeout_ms = prompt ? 30000 : 3000;
    halo_comm_t c = make_comm(port, timeout_ms);
    int64_t shape[2] = {64, 256};
    halo_plan_params_t p = params(shape);
    p.dim = 0;
    p.left = p.right = 2;
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    static float x[64 * 256], out[68 * 256];
    HALO_OK(halo_plan_forward(plan, x, out));
    if (g_rank == 1) {
        usleep(100000);
        raise(SIGKILL); /* dies while the others' exchange is in flight */
    }
    double t0 = now_s();
    HALO_OK(halo_plan_forward_start(plan, x, out));
    usleep(300000); /* computing, while rank 1 dies */
    halo_result_t rc = halo_plan_wait(plan, HALO_DIR_FORWARD);
    double took = now_s() - t0;
    CHECK(rc == HALO_ERR_TIMEOUT || rc == HALO_ERR_PEER_FAILED, "wait with a dead peer returned %s: %s", halo_strerror(rc), halo_last_error());
    CHECK(strstr(halo_last_error(), "rank 1") != NULL, "message does not name rank 1: %s", halo_last_error());
    CHECK(took < timeout_ms / 1000.0 + 2.0, "took %.2f s for a %ld ms deadline", took, (long)timeout_ms);
    if (prompt) {
        /* 0.3 s of it is the rank's own computing */
        CHECK(rc == HALO_ERR_PEER_FAILED, "wait with a killed peer returned %s, want PEER_FAILED: %s", halo_strerror(rc), halo_last_error());
        CHECK(took < 3.0, "the killed peer was found after %.2f s (deadline %ld ms), want < 3 s", took, (long)timeout_ms);
    }
    t0 = now_s();
    HALO_OK(halo_comm_destroy(c));
    CHECK(now_s() - t0 < 5.0, "destroy took %.2f s", now_s() - t0);
    return g_failures ? 1 : 0;
}

static void *abort_later(void *comm) {
    usleep(300000);
    halo_result_t rc = halo_comm_abort((halo_comm_t)comm);
    if (rc != HALO_SUCCESS) fprintf(stderr, "rank %d: halo_comm_abort: %s\n", g_rank, halo_last_error());
    return NULL;
}

static int rank_abort(int port) {
    const int64_t timeout_ms = 60000; /* far beyond the test's patience */
    halo_comm_t c = make_comm(port, timeout_ms);
    int64_t shape[2] = {4, 32};
    halo_plan_params_t p = params(shape);
    p.dim = 0;
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    static float x[4 * 32], out[6 * 32];
    if (g_rank == 1) {
        usleep(1500000); /* never joins the exchange rank 0 blocks in */
        HALO_OK(halo_comm_destroy(c));
        return 0;
    }
    pthread_t t;
    pthread_create(&t, NULL, abort_later, c);
    double t0 = now_s();
    halo_result_t rc = halo_plan_forward(plan, x, out);
    double took = now_s() - t0;
    pthread_join(t, NULL);
    CHECK(rc == HALO_ERR_COMM_FAILED, "blocked forward after abort returned %s: %s", halo_strerror(rc), halo_last_error());
    CHECK(took < 0.3 + 0.5, "the blocked forward returned %.3f s after it began, the abort came at 0.3 s", took);
    expect(halo_plan_forward(plan, x, out), HALO_ERR_COMM_FAILED, "aborted", "a call after the abort");
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_COMM_FAILED, "aborted", "a plan after the abort");
    HALO_OK(halo_comm_abort(c)); /* idempotent */
    t0 = now_s();
    HALO_OK(halo_comm_destroy(c));
    CHECK(now_s() - t0 < 1.0, "destroy after abort took %.2f s", now_s() - t0);
    expect(halo_comm_abort(c), HALO_ERR_INVALID_HANDLE, NULL, "abort of a destroyed communicator");
    printf("test_errors abort: the blocked forward returned %s after %.3f s\n", halo_strerror(rc), took);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "args";
    if (rank_args(argc, argv, &port)) {
        if (has_flag(argc, argv, "mismatch")) return rank_mismatch(port);
        if (has_flag(argc, argv, "async")) return rank_async(port);
        if (has_flag(argc, argv, "async_kill")) return rank_async_kill(port, 0);
        if (has_flag(argc, argv, "async_kill_prompt")) return rank_async_kill(port, 1);
        if (has_flag(argc, argv, "abort")) return rank_abort(port);
        return rank_kill(port, has_flag(argc, argv, "kill_prompt"));
    }
    if (!strcmp(mode, "args")) return test_args();
    char *extra[1] = {(char *)mode};
    if (!strcmp(mode, "mismatch")) {
        int bad = launch(argv[0], 3, 120, NULL, 1, extra);
        printf("test_errors mismatch: %s\n", bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    if (!strcmp(mode, "kill") || !strcmp(mode, "kill_prompt")) {
        int sig[2] = {0, SIGKILL};
        int bad = launch(argv[0], 2, 120, sig, 1, extra);
        printf("test_errors %s: %s\n", mode, bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    if (!strcmp(mode, "async") || !strcmp(mode, "abort")) {
        int bad = launch(argv[0], 2, 60, NULL, 1, extra);
        printf("test_errors %s: %s\n", mode, bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    if (!strcmp(mode, "async_kill") || !strcmp(mode, "async_kill_prompt")) {
        int sig[3] = {0, SIGKILL, 0};
        int bad = launch(argv[0], 3, 60, sig, 1, extra);
        printf("test_errors %s: %s\n", mode, bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    fprintf(stderr, "usage: %s args|mismatch|kill|kill_prompt|async|async_kill|async_kill_prompt|abort\n", argv[0]);
    return 2;
}
