/* How much of an exchange a caller hides behind its own work, from C.
 *
 * Two ranks (real processes, shared memory) exchange a 1-D float32 halo of
 * 2 KiB and of 2 MiB, forward and backward. For each, median times of:
 *   block   the blocking call alone
 *   work    the caller's work alone: memcpy of 256 KiB chunks, as many as
 *           take about as long as the blocking call (an interior copy)
 *   none    start, the work, wait: nothing progresses the exchange meanwhile
 *   test    start, the work with halo_plan_test after every chunk, wait
 *   thread  start, the work while another thread calls halo_plan_test until
 *           the exchange is done, then wait if it is not
 * and hidden = (block + work - mode) / block: the fraction of the exchange
 * that cost nothing (1 = fully hidden, 0 = none, below 0 = it got in the way).
 * Then the CPU time rank 0 spends in a forward that waits 200 ms for rank 1
 * (a peer still computing): what a long wait costs the rank's other threads.
 *
 *   halo_overlap [--iters N]     from the build folder: build/tests/halo_overlap
 */
#include <pthread.h>

#include "launch.h"

#define CHUNK (256 << 10)

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp_double);
    return v[n / 2];
}

typedef struct {
    halo_plan_t plan;
    halo_direction_t dir;
    volatile int stop, done;
} progress_arg;

static void *progress(void *p) {
    progress_arg *a = p;
    while (!a->stop && !a->done) {
        int d = 0;
        if (halo_plan_test(a->plan, a->dir, &d) != HALO_SUCCESS) break;
        a->done = d;
    }
    return NULL;
}

static unsigned char *work_src, *work_dst;

static void work(int chunks) {
    for (int i = 0; i < chunks; i++) memcpy(work_dst, work_src + (size_t)(i % 4) * CHUNK, CHUNK);
}

enum { BLOCK, WORK, NONE, TEST, THREAD, NMODES };

/* One call of mode m; returns its time in seconds. */
static double once(int m, halo_plan_t plan, halo_direction_t dir, float *x, float *out, int chunks) {
    double t0 = now_s();
    int done = 0;
    halo_result_t (*start)(halo_plan_t, const void *, void *) = dir == HALO_DIR_FORWARD ? halo_plan_forward_start : halo_plan_backward_start;
    halo_result_t (*blocking)(halo_plan_t, const void *, void *) = dir == HALO_DIR_FORWARD ? halo_plan_forward : halo_plan_backward;
    const void *src = dir == HALO_DIR_FORWARD ? (const void *)x : (const void *)out;
    void *dst = dir == HALO_DIR_FORWARD ? (void *)out : (void *)x;
    switch (m) {
    case BLOCK: HALO_OK(blocking(plan, src, dst)); break;
    case WORK: work(chunks); break;
    case NONE:
        HALO_OK(start(plan, src, dst));
        work(chunks);
        HALO_OK(halo_plan_wait(plan, dir));
        break;
    case TEST:
        HALO_OK(start(plan, src, dst));
        for (int i = 0; i < chunks; i++) {
            memcpy(work_dst, work_src + (size_t)(i % 4) * CHUNK, CHUNK);
            if (!done) HALO_OK(halo_plan_test(plan, dir, &done));
        }
        if (!done) HALO_OK(halo_plan_wait(plan, dir));
        break;
    case THREAD: {
        HALO_OK(start(plan, src, dst));
        progress_arg a = {plan, dir, 0, 0};
        pthread_t t;
        pthread_create(&t, NULL, progress, &a);
        work(chunks);
        a.stop = 1;
        pthread_join(t, NULL);
        if (!a.done) HALO_OK(halo_plan_wait(plan, dir));
        break;
    }
    }
    return now_s() - t0;
}

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void long_wait(halo_comm_t comm) {
    int64_t shape[1] = {1024};
    halo_plan_params_t p;
    memset(&p, 0, sizeof p);
    p.dtype = HALO_FLOAT32;
    p.ndim = 1;
    p.shape = shape;
    p.left = p.right = 16;
    halo_plan_t plan;
    HALO_OK(halo_plan_create(comm, &p, &plan));
    static float x[1024], out[1024 + 32];
    HALO_OK(halo_plan_forward(plan, x, out));
    if (g_rank == 1) usleep(200000);
    double w = now_s(), c = cpu_s();
    HALO_OK(halo_plan_forward(plan, x, out));
    if (g_rank == 0)
        printf("# a forward that waited %.0f ms for its peer used %.1f ms of CPU\n", (now_s() - w) * 1e3, (cpu_s() - c) * 1e3);
    HALO_OK(halo_plan_destroy(plan));
}

static int run_rank(int port, int iters) {
    halo_comm_t comm = make_comm(port, 60000);
    work_src = malloc(4 * CHUNK);
    work_dst = malloc(CHUNK);
    memset(work_src, 1, 4 * CHUNK);
    memset(work_dst, 2, CHUNK);
    static const int64_t halo_bytes[] = {2048, 2 << 20};
    if (g_rank == 0) {
        printf("# halo_overlap: 2 ranks, float32, in place; median of %d; work = memcpy of %d KiB chunks\n", iters, CHUNK >> 10);
        printf("#%9s %4s %10s %10s %10s %10s %10s   %s\n", "halo", "op", "block us", "work us", "none us", "test us", "thread us",
               "hidden: none test thread");
    }
    for (int s = 0; s < 2; s++) {
        int64_t h = halo_bytes[s] / 4, n = 4 * h; /* the shard: 4 halos long */
        int64_t shape[1] = {n};
        int64_t out_strides[1] = {1};
        halo_plan_params_t p;
        memset(&p, 0, sizeof p);
        p.dtype = HALO_FLOAT32;
        p.ndim = 1;
        p.shape = shape;
        p.dim = 0;
        p.left = p.right = h;
        p.field_mask = HALO_PLAN_PARAM_OUT_STRIDES | HALO_PLAN_PARAM_X_STRIDES;
        p.out_strides = out_strides;
        p.x_strides = out_strides;
        halo_plan_t plan;
        HALO_OK(halo_plan_create(comm, &p, &plan));
        float *out = calloc(n + 2 * h, sizeof(float)), *x = out + h; /* in place */
        for (int d = 0; d < 2; d++) {
            halo_direction_t dir = d ? HALO_DIR_BACKWARD : HALO_DIR_FORWARD;
            double t[NMODES][1000], med[NMODES];
            int chunks = 1;
            for (int i = 0; i < 50; i++) once(BLOCK, plan, dir, x, out, 0); /* warm up */
            for (int i = 0; i < iters; i++) t[BLOCK][i] = once(BLOCK, plan, dir, x, out, 0);
            med[BLOCK] = median(t[BLOCK], iters);
            /* Work of about the blocking call's length. */
            double tc = now_s();
            for (int i = 0; i < 64; i++) memcpy(work_dst, work_src + (size_t)(i % 4) * CHUNK, CHUNK);
            tc = (now_s() - tc) / 64;
            chunks = (int)(med[BLOCK] / tc + 0.5); /* each rank its own: both do about as much */
            if (chunks < 1) chunks = 1;
            for (int m = WORK; m < NMODES; m++) {
                for (int i = 0; i < iters; i++) t[m][i] = once(m, plan, dir, x, out, chunks);
                med[m] = median(t[m], iters);
            }
            if (g_rank == 0) {
                printf("%10ld %4s %10.2f %10.2f %10.2f %10.2f %10.2f   %6.2f %5.2f %6.2f\n", (long)halo_bytes[s], d ? "bwd" : "fwd",
                       med[BLOCK] * 1e6, med[WORK] * 1e6, med[NONE] * 1e6, med[TEST] * 1e6, med[THREAD] * 1e6,
                       (med[BLOCK] + med[WORK] - med[NONE]) / med[BLOCK], (med[BLOCK] + med[WORK] - med[TEST]) / med[BLOCK],
                       (med[BLOCK] + med[WORK] - med[THREAD]) / med[BLOCK]);
            }
        }
        HALO_OK(halo_plan_destroy(plan));
        free(out);
    }
    long_wait(comm);
    HALO_OK(halo_comm_destroy(comm));
    return g_failures ? 1 : 0;
}

int main(int argc, char **argv) {
    int port = 0, iters = 200;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
    if (iters < 1 || iters > 1000) {
        fprintf(stderr, "usage: %s [--iters 1..1000]\n", argv[0]);
        return 2;
    }
    if (rank_args(argc, argv, &port)) return run_rank(port, iters);
    char its[16];
    snprintf(its, sizeof its, "%d", iters);
    char *extra[2] = {"--iters", its};
    int bad = launch(argv[0], 2, 600, NULL, 2, extra);
    return bad ? 1 : 0;
}
