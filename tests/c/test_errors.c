/* Bad input through the C ABI: every validated argument returns its code and
 * a message that says what was wrong; ranks that disagree all fail; a peer
 * killed with SIGKILL makes the survivor fail within its deadline.
 *
 *   test_errors args        single process: argument validation
 *   test_errors mismatch    3 ranks, rank 2 disagrees on the dtype
 *   test_errors kill        2 ranks, rank 1 dies during an exchange */
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
    p.padding = (halo_padding_t)3;
    expect(halo_plan_create(c, &p, &plan), HALO_ERR_INVALID_ARGUMENT, "unknown padding 3", "bad padding");
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
    /* the communicator stays usable after a mismatch */
    p.dtype = HALO_FLOAT32;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[12] = {0}, out[18];
    HALO_OK(halo_plan_forward(plan, x, out));
    HALO_OK(halo_comm_destroy(c));
    return g_failures ? 1 : 0;
}

static int rank_kill(int port) {
    const int64_t timeout_ms = 3000;
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
    CHECK(rc == HALO_ERR_TIMEOUT || rc == HALO_ERR_PEER_FAILED, "forward with a dead peer returned %s: %s", halo_strerror(rc), halo_last_error());
    CHECK(strstr(halo_last_error(), "rank 1") != NULL, "message does not name rank 1: %s", halo_last_error());
    CHECK(took < timeout_ms / 1000.0 + 2.0, "took %.2f s for a %ld ms deadline", took, (long)timeout_ms);
    rc = halo_plan_forward(plan, x, out);
    CHECK(rc == HALO_ERR_COMM_FAILED, "after a failure: %s: %s", halo_strerror(rc), halo_last_error());
    t0 = now_s();
    HALO_OK(halo_comm_destroy(c));
    CHECK(now_s() - t0 < 5.0, "destroy took %.2f s", now_s() - t0);
    printf("test_errors kill: rank 0 saw: %s (after %.2f s)\n", "error", took);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "args";
    if (rank_args(argc, argv, &port)) {
        if (has_flag(argc, argv, "mismatch")) return rank_mismatch(port);
        return rank_kill(port);
    }
    if (!strcmp(mode, "args")) return test_args();
    char *extra[1] = {(char *)mode};
    if (!strcmp(mode, "mismatch")) {
        int bad = launch(argv[0], 3, 120, NULL, 1, extra);
        printf("test_errors mismatch: %s\n", bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    if (!strcmp(mode, "kill")) {
        int sig[2] = {0, SIGKILL};
        int bad = launch(argv[0], 2, 120, sig, 1, extra);
        printf("test_errors kill: %s\n", bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    fprintf(stderr, "usage: %s args|mismatch|kill\n", argv[0]);
    return 2;
}
