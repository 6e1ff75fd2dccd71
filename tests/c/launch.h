/* Test launcher shared by the C tests: the same binary runs as a launcher
 * (spawns W rank processes of itself) and as a rank. Real processes, real
 * rendezvous on loopback. */
#ifndef HALO_TEST_LAUNCH_H
#define HALO_TEST_LAUNCH_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "halo.h"

extern char **environ;

static int g_rank = -1, g_world = 0;
static int g_failures = 0;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "rank %d: %s:%d: check failed: %s: ", g_rank,       \
                    __FILE__, __LINE__, #cond);                                 \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
            g_failures++;                                                       \
        }                                                                       \
    } while (0)

/* Calls a halo function; on failure prints the code and the detailed message. */
#define HALO_OK(call)                                                           \
    do {                                                                        \
        halo_result_t rc_ = (call);                                             \
        if (rc_ != HALO_SUCCESS) {                                              \
            fprintf(stderr, "rank %d: %s:%d: %s -> %s: %s\n", g_rank, __FILE__, \
                    __LINE__, #call, halo_strerror(rc_), halo_last_error());    \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

/* A free port below the kernel's ephemeral range (32768 and up here):
 * a port bind(0) handed out could be handed out again, before a rank binds
 * it, to any listener of a test running beside this one (every rank holds
 * a liveness listener on an ephemeral port). */
static int free_port(void) {
    srand((unsigned)getpid() ^ (unsigned)time(NULL));
    for (int tries = 0; tries < 1000; tries++) {
        int port = 20000 + rand() % 12000;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons((unsigned short)port);
        if (fd < 0) break;
        int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
        close(fd);
        if (ok) return port;
    }
    perror("free_port");
    exit(2);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Spawns W ranks of argv[0] with "--rank r --world W --port P <extra...>"
 * and waits for all of them, at most timeout_s. expect_signal[r] != 0 says
 * rank r is expected to die of that signal. Returns the number of ranks that
 * did not end as expected. */
static int launch(const char *self, int W, int timeout_s, const int *expect_signal, int nextra, char **extra) {
    int port = free_port();
    pid_t pids[64];
    char rs[16], ws[16], ps[16];
    snprintf(ws, sizeof ws, "%d", W);
    snprintf(ps, sizeof ps, "%d", port);
    for (int r = 0; r < W; r++) {
        snprintf(rs, sizeof rs, "%d", r);
        char *args[32] = {(char *)self, "--rank", rs, "--world", ws, "--port", ps};
        int n = 7;
        for (int i = 0; i < nextra && n < 31; i++) args[n++] = extra[i];
        args[n] = NULL;
        if (posix_spawn(&pids[r], self, NULL, NULL, args, environ) != 0) {
            perror("posix_spawn");
            return W;
        }
    }
    int bad = 0, left = W;
    double deadline = now_s() + timeout_s;
    int done[64] = {0};
    while (left > 0) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p == 0) {
            if (now_s() > deadline) {
                for (int r = 0; r < W; r++)
                    if (!done[r]) {
                        fprintf(stderr, "launcher: rank %d (pid %d) still running after %d s: killing it\n", r, (int)pids[r], timeout_s);
                        kill(pids[r], SIGKILL);
                        waitpid(pids[r], NULL, 0);
                        bad++;
                    }
                return bad;
            }
            usleep(10000);
            continue;
        }
        if (p < 0) break;
        for (int r = 0; r < W; r++) {
            if (pids[r] != p) continue;
            done[r] = 1;
            left--;
            int want = expect_signal ? expect_signal[r] : 0;
            if (want) {
                if (!WIFSIGNALED(status) || WTERMSIG(status) != want) {
                    fprintf(stderr, "launcher: rank %d should have died of signal %d (status %#x)\n", r, want, status);
                    bad++;
                }
            } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                fprintf(stderr, "launcher: rank %d failed (status %#x)\n", r, status);
                bad++;
            }
        }
    }
    return bad;
}

/* Parses the rank arguments; returns 1 in a rank, 0 in the launcher. */
static int rank_args(int argc, char **argv, int *port) {
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--rank")) g_rank = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--world")) g_world = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--port")) *port = atoi(argv[i + 1]);
    }
    return g_rank >= 0;
}

/* The layout most multi-rank tests exchange: float32, 1-D, shape[0]
 * slices, left and right halo slices. */
static inline halo_plan_params_t plan_1d(int64_t *shape, int64_t left, int64_t right) {
    halo_plan_params_t p = HALO_PLAN_PARAMS_INITIALIZER;
    p.ndim = 1;
    p.shape = shape;
    p.left = left;
    p.right = right;
    return p;
}

static int has_flag(int argc, char **argv, const char *flag) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], flag)) return 1;
    return 0;
}

static halo_comm_t make_comm(int port, int64_t timeout_ms) {
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    halo_comm_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = HALO_COMM_PARAM_RENDEZVOUS | HALO_COMM_PARAM_TIMEOUT | HALO_COMM_PARAM_BOOTSTRAP_TIMEOUT;
    p.rendezvous = addr;
    p.timeout_ms = timeout_ms;
    p.bootstrap_timeout_ms = 30000;
    halo_comm_t c;
    HALO_OK(halo_comm_create(g_rank, g_world, &p, &c));
    return c;
}

#endif
