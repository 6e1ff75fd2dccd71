/* A peer that is gone, seen from the rank that stays (issue 24 §4).
 *
 *   test_gone connect   rank 1 hands out its address (external bootstrap)
 *                       and ends; rank 0's halo_comm_connect must return
 *                       HALO_ERR_PEER_FAILED naming rank 1, with nothing of
 *                       UCX's on stderr (it returned HALO_ERR_TRANSPORT, and
 *                       UCX printed its shared-memory errors)
 *   test_gone abort     2 ranks; rank 0 starts an exchange, aborts and
 *                       destroys its communicator and stays alive; every
 *                       later exchange of rank 1 must fail within its
 *                       deadline, naming rank 0 (the first returned
 *                       success: it matched the sends of rank 0's started
 *                       exchange, which UCX had delivered)
 *   test_gone abort_idle  the same with nothing in flight, rank 1 starting
 *                       with an exchange that only sends to rank 0
 *   test_gone abort_kept  as abort, rank 0 keeping its aborted communicator
 *                       (destroyed only after rank 1 is done), rank 1's first
 *                       exchange started and tested rather than waited for */
#include "launch.h"

/* Rank `rank` of 2 with an external bootstrap, and its address. */
static halo_comm_t external_comm(int rank, const void **addr, size_t *len) {
    halo_comm_params_t p = HALO_COMM_PARAMS_INITIALIZER;
    p.field_mask = HALO_COMM_PARAM_BOOTSTRAP;
    p.bootstrap = HALO_BOOTSTRAP_EXTERNAL;
    halo_comm_t c;
    HALO_OK(halo_comm_create(rank, 2, &p, &c));
    HALO_OK(halo_comm_get_address(c, addr, len));
    return c;
}

/* The child of "connect": prints its address in hex and exits at once. */
static int gone_child(void) {
    const void *a;
    size_t n;
    external_comm(1, &a, &n);
    for (size_t i = 0; i < n; i++) printf("%02x", ((const unsigned char *)a)[i]);
    printf("\n");
    fflush(stdout);
    _exit(0); /* gone, without a goodbye */
}

static int test_connect(const char *self) {
    g_rank = 0;
    int fds[2];
    if (pipe(fds) != 0) {
        perror("pipe");
        return 1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    char *args[] = {(char *)self, "--gone-child", NULL};
    pid_t pid;
    if (posix_spawn(&pid, self, &fa, NULL, args, environ) != 0) {
        perror("posix_spawn");
        return 1;
    }
    close(fds[1]);
    static char hex[1 << 16];
    size_t got = 0;
    ssize_t r;
    while (got + 1 < sizeof hex && (r = read(fds[0], hex + got, sizeof hex - 1 - got)) > 0) got += (size_t)r;
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    static unsigned char addr[1 << 15];
    size_t n = 0;
    for (; n < sizeof addr && 2 * n + 1 < got && hex[2 * n] != '\n'; n++) {
        unsigned v;
        sscanf(hex + 2 * n, "%2x", &v);
        addr[n] = (unsigned char)v;
    }
    CHECK(WIFEXITED(status) && n > 0, "the child gave no address (status %#x)", status);

    const void *own;
    size_t own_len;
    halo_comm_t c = external_comm(0, &own, &own_len);
    const void *addrs[2] = {own, addr};
    size_t lens[2] = {own_len, n};

    /* What is printed on stderr during the connect goes to a file. */
    char errfile[] = "halo-gone-stderr-XXXXXX"; /* in the working directory */
    int efd = mkstemp(errfile), saved = dup(2);
    fflush(stderr);
    dup2(efd, 2);
    halo_result_t rc = halo_comm_connect(c, addrs, lens);
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", halo_last_error());
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    static char printed[1 << 14];
    ssize_t pn = pread(efd, printed, sizeof printed - 1, 0);
    printed[pn > 0 ? pn : 0] = '\0';
    close(efd);
    unlink(errfile);

    printf("test_gone connect: %s: %s\n", halo_strerror(rc), msg);
    CHECK(rc == HALO_ERR_PEER_FAILED, "connect to a gone rank returned %s, want HALO_ERR_PEER_FAILED", halo_strerror(rc));
    CHECK(strstr(msg, "rank 1") != NULL, "the message does not name rank 1: %s", msg);
    CHECK(printed[0] == '\0', "the connect printed on stderr:\n%s", printed);
    halo_comm_destroy(c);
    printf("test_gone connect: %s\n", g_failures ? "FAILED" : "passed");
    return g_failures ? 1 : 0;
}

/* in_flight: rank 0 aborts with a forward started (its sends out: they
 * reached rank 1, whose next forward completed on them and returned success
 * before the goodbye); otherwise with nothing in flight, and rank 1 starts
 * with a backward of a causal plan, which only sends to rank 0. */
static int rank_abort(int port, int in_flight, int kept) {
    const int64_t timeout_ms = 2000;
    halo_comm_t c = make_comm(port, timeout_ms);
    int64_t shape[1] = {4};
    halo_plan_params_t p = plan_1d(shape, 1, 1);
    if (!in_flight) p.right = 0;
    halo_plan_t plan;
    HALO_OK(halo_plan_create(c, &p, &plan));
    float x[4] = {1, 2, 3, 4}, out[6], gx[4], g[6] = {1, 1, 1, 1, 1, 1};
    HALO_OK(halo_plan_forward(plan, x, out));
    if (g_rank == 0) {
        /* The abort and the destroy; the process stays, as a trainer that
         * handles the error would. */
        usleep(200000); /* rank 1 done with the forward above */
        if (in_flight) HALO_OK(halo_plan_forward_start(plan, x, out));
        HALO_OK(halo_comm_abort(c));
        if (kept) usleep(1500000); /* the communicator kept, aborted */
        halo_plan_destroy(plan);
        HALO_OK(halo_comm_destroy(c));
        if (!kept) usleep(1500000);
        return 0;
    }
    usleep(500000);
    for (int step = 0; step < 4; step++) {
        double t0 = now_s();
        int backward = (step + !in_flight) % 2;
        halo_result_t rc;
        if (kept && step == 0) { /* started and tested, as an overlapped exchange is */
            int done = 0;
            rc = halo_plan_forward_start(plan, x, out);
            while (rc == HALO_SUCCESS && !done) rc = halo_plan_test(plan, HALO_DIR_FORWARD, &done);
        } else {
            rc = backward ? halo_plan_backward(plan, g, gx) : halo_plan_forward(plan, x, out);
        }
        double took = now_s() - t0;
        const char *msg = halo_last_error();
        printf("rank 1: %s %d after rank 0 aborted: %s after %.3f s: %s\n", backward ? "backward" : "forward", step,
               halo_strerror(rc), took, rc == HALO_SUCCESS ? "" : msg);
        CHECK(rc != HALO_SUCCESS, "exchange %d with an aborted rank 0 succeeded", step);
        CHECK(rc == HALO_SUCCESS || strstr(msg, "rank 0") != NULL, "exchange %d: the message does not name rank 0: %s", step, msg);
        CHECK(took < timeout_ms / 1000.0 + 1.0, "exchange %d took %.2f s for a %ld ms deadline", step, took, (long)timeout_ms);
    }
    halo_plan_destroy(plan);
    halo_comm_destroy(c);
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (has_flag(argc, argv, "--gone-child")) return gone_child();
    if (rank_args(argc, argv, &port))
        return rank_abort(port, !has_flag(argc, argv, "abort_idle"), has_flag(argc, argv, "abort_kept"));
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "connect")) return test_connect(argv[0]);
    if (!strcmp(mode, "abort") || !strcmp(mode, "abort_idle") || !strcmp(mode, "abort_kept")) {
        char *extra[1] = {(char *)mode};
        int bad = launch(argv[0], 2, 60, NULL, 1, extra);
        printf("test_gone %s: %s\n", mode, bad ? "FAILED" : "passed");
        return bad ? 1 : 0;
    }
    fprintf(stderr, "usage: %s connect|abort|abort_idle|abort_kept\n", argv[0]);
    return 2;
}
