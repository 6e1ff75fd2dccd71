/* The halo exchange that halod bench times, done with plain MPI: the peer
 * that halo is held against (bench/core.sh runs both in the same run).
 *
 * Each rank holds x, a float32 tensor viewed as [outer, slices, inner],
 * sharded along the middle axis, in place inside out = [left | x | right]
 * (L and R slices, L, R <= slices). Forward: MPI_Irecv the halos straight
 * into out (a vector datatype when outer > 1), MPI_Isend x's boundary slabs,
 * zero the halo slots outside the sequence, MPI_Waitall. Backward: MPI_Irecv
 * the neighbours' halo gradients into two contiguous buffers, MPI_Isend
 * ours, zero-add on the edge ranks as the reference does, MPI_Waitall, then
 * a plain add loop, the gradient from the right neighbour first (the
 * reference's order). That is what a careful MPI user writes; halo's own
 * exchange does the same work with the same results, bit for bit.
 *
 * Every rank times each call with MPI_Wtime; per iteration the slowest rank's
 * time counts, and p50 and p99 are taken over those (as halod bench does).
 * With --check every call's result is verified (outside the timed interval).
 *
 *   mpirun -np 2 mpi_halo --bytes 2048 --op both
 *   mpirun -np 2 mpi_halo --shape 64x4x8192 --op both   (outer x slices x inner)
 *
 * Options: --bytes B (a [1, B/4] shard, one slice, L = R = 1, the sweep of
 * halod bench), or --shape OxTxI with --left L --right R (default 1, 1);
 * --op fwd|bwd|both; --warmup N (100); --duration S (seconds per op, 2);
 * --min-iters N (200); --max-iters N (1000000); --check.
 * Prints one table row per op; exit status 3 if any value was wrong.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    long outer, slices, inner, L, R;
    int fwd, bwd, warmup, min_iters, max_iters, check;
    double duration;
} options;

typedef struct {
    int rank, size, left, right; /* neighbours, MPI_PROC_NULL at the edges */
    long P;                      /* padded slices: L + slices + R */
    float *out, *grad;           /* [outer, P, inner] each */
    float *from_left, *from_right; /* backward staging: [outer, R, inner], [outer, L, inner] */
    MPI_Datatype slab_l, slab_r;   /* L and R slices of every outer index */
} exchange;

static void die(const char *msg) {
    fprintf(stderr, "mpi_halo: %s\n", msg);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

/* The slab of padded slices [s, s+n) of t: a count and a datatype. */
typedef struct {
    void *buf;
    int count;
    MPI_Datatype type;
} slab;

static slab slab_of(const options *o, const exchange *e, float *t, long s, long n) {
    slab b = {t + s * o->inner, (int)(n * o->inner), MPI_FLOAT};
    if (o->outer > 1) {
        b.count = 1;
        b.type  = n == o->L ? e->slab_l : e->slab_r;
    }
    return b;
}

/* t[o, s, i] over slices [s, s+n) of a padded tensor, one call per run. */
#define FOR_RUNS(o, e, s, n, body)                                             \
    for (long ou_ = 0; ou_ < (o)->outer; ou_++) {                              \
        size_t base_ = ((size_t)ou_ * (e)->P + (size_t)(s)) * (o)->inner;     \
        size_t len_  = (size_t)(n) * (o)->inner;                               \
        size_t src_  = (size_t)ou_ * len_;                                     \
        (void)src_;                                                            \
        body                                                                   \
    }

static void add_run(float *restrict dst, const float *restrict src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

static void add_zero_run(float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] += 0.0f;
}

static void forward(const options *o, exchange *e) {
    MPI_Request rq[4];
    int k = 0;
    long T = o->slices, L = o->L, R = o->R;
    slab b;
    if (L > 0) {
        b = slab_of(o, e, e->out, 0, L);
        MPI_Irecv(b.buf, b.count, b.type, e->left, 1, MPI_COMM_WORLD, &rq[k++]);
    }
    if (R > 0) {
        b = slab_of(o, e, e->out, L + T, R);
        MPI_Irecv(b.buf, b.count, b.type, e->right, 1, MPI_COMM_WORLD, &rq[k++]);
        b = slab_of(o, e, e->out, L, R);
        MPI_Isend(b.buf, b.count, b.type, e->left, 1, MPI_COMM_WORLD, &rq[k++]);
    }
    if (L > 0) {
        b = slab_of(o, e, e->out, T, L);
        MPI_Isend(b.buf, b.count, b.type, e->right, 1, MPI_COMM_WORLD, &rq[k++]);
    }
    if (e->left == MPI_PROC_NULL && L > 0) FOR_RUNS(o, e, 0, L, memset(e->out + base_, 0, len_ * sizeof(float));)
    if (e->right == MPI_PROC_NULL && R > 0) FOR_RUNS(o, e, L + T, R, memset(e->out + base_, 0, len_ * sizeof(float));)
    MPI_Waitall(k, rq, MPI_STATUSES_IGNORE);
}

static void backward(const options *o, exchange *e) {
    MPI_Request rq[4];
    int k = 0;
    long T = o->slices, L = o->L, R = o->R;
    slab b;
    if (L > 0) MPI_Irecv(e->from_right, (int)(o->outer * L * o->inner), MPI_FLOAT, e->right, 2, MPI_COMM_WORLD, &rq[k++]);
    if (R > 0) MPI_Irecv(e->from_left, (int)(o->outer * R * o->inner), MPI_FLOAT, e->left, 2, MPI_COMM_WORLD, &rq[k++]);
    if (L > 0) {
        b = slab_of(o, e, e->grad, 0, L);
        MPI_Isend(b.buf, b.count, b.type, e->left, 2, MPI_COMM_WORLD, &rq[k++]);
    }
    if (R > 0) {
        b = slab_of(o, e, e->grad, L + T, R);
        MPI_Isend(b.buf, b.count, b.type, e->right, 2, MPI_COMM_WORLD, &rq[k++]);
    }
    /* The reference adds a zero tensor where no neighbour sends (-0 -> +0). */
    if (e->right == MPI_PROC_NULL && L > 0) FOR_RUNS(o, e, T, L, add_zero_run(e->grad + base_, len_);)
    if (e->left == MPI_PROC_NULL && R > 0) FOR_RUNS(o, e, L, R, add_zero_run(e->grad + base_, len_);)
    MPI_Waitall(k, rq, MPI_STATUSES_IGNORE);
    if (e->right != MPI_PROC_NULL && L > 0) FOR_RUNS(o, e, T, L, add_run(e->grad + base_, e->from_right + src_, len_);)
    if (e->left != MPI_PROC_NULL && R > 0) FOR_RUNS(o, e, L, R, add_run(e->grad + base_, e->from_left + src_, len_);)
}

/* ---- data for --check: every rank can compute every rank's values ---- */

static uint32_t mix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352dU;
    h ^= h >> 15;
    h *= 0x846ca68bU;
    return h ^ (h >> 16);
}

/* x at global slice g: an integer below 2^12, exact in float32. */
static float x_value(int it, long o, long g, long i) {
    return (float)(mix((uint32_t)(it * 7919 + o * 104729 + g * 1299709 + i)) & 0xfff);
}

/* grad_out of rank r at padded slice p: a small integer, so every sum is exact. */
static float g_value(int r, int it, long o, long p, long i) {
    return (float)((int)(mix((uint32_t)(r * 15485863 + it * 7919 + o * 104729 + p * 1299709 + i)) % 17) - 8);
}

static void fill_forward(const options *o, exchange *e, int it) {
    for (long ou = 0; ou < o->outer; ou++)
        for (long p = 0; p < e->P; p++)
            for (long i = 0; i < o->inner; i++) {
                float *v = &e->out[((size_t)ou * e->P + p) * o->inner + i];
                int halo = p < o->L || p >= o->L + o->slices;
                *v = halo ? NAN : x_value(it, ou, e->rank * o->slices + p - o->L, i);
            }
}

static long check_forward(const options *o, exchange *e, int it) {
    long wrong = 0, total = o->slices * e->size;
    for (long ou = 0; ou < o->outer; ou++)
        for (long p = 0; p < e->P; p++) {
            long g = e->rank * o->slices + p - o->L;
            for (long i = 0; i < o->inner; i++) {
                float want = (g < 0 || g >= total) ? 0.0f : x_value(it, ou, g, i);
                float got = e->out[((size_t)ou * e->P + p) * o->inner + i];
                if (memcmp(&got, &want, sizeof got) != 0) wrong++;
            }
        }
    return wrong;
}

static void fill_backward(const options *o, exchange *e, int it) {
    for (long ou = 0; ou < o->outer; ou++)
        for (long p = 0; p < e->P; p++)
            for (long i = 0; i < o->inner; i++)
                e->grad[((size_t)ou * e->P + p) * o->inner + i] = g_value(e->rank, it, ou, p, i);
}

static long check_backward(const options *o, exchange *e, int it) {
    long wrong = 0, T = o->slices, L = o->L, R = o->R;
    for (long ou = 0; ou < o->outer; ou++)
        for (long s = 0; s < T; s++)
            for (long i = 0; i < o->inner; i++) {
                float want = g_value(e->rank, it, ou, L + s, i);
                if (s >= T - L && e->right != MPI_PROC_NULL) want += g_value(e->right, it, ou, s - (T - L), i);
                if (s < R && e->left != MPI_PROC_NULL) want += g_value(e->left, it, ou, L + T + s, i);
                if (e->grad[((size_t)ou * e->P + L + s) * o->inner + i] != want) wrong++;
            }
    return wrong;
}

/* ---- timing ---- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The nearest-rank q-quantile of sorted v. */
static double quantile(const double *v, int n, double q) {
    int k = (int)ceil(q * n) - 1;
    return v[k < 0 ? 0 : k];
}

/* One call of op, timed; with check, data is filled and verified outside. */
static double once(const options *o, exchange *e, int bwd, int it, long *wrong) {
    if (o->check) (bwd ? fill_backward : fill_forward)(o, e, it);
    double t0 = MPI_Wtime();
    (bwd ? backward : forward)(o, e);
    double t = MPI_Wtime() - t0;
    if (o->check) *wrong += (bwd ? check_backward : check_forward)(o, e, it);
    return t;
}

static long run(const options *o, exchange *e, int bwd) {
    long wrong = 0;
    int n = o->warmup > 0 ? o->warmup : 1;
    double *w = malloc(sizeof(double) * n), med;
    for (int i = 0; i < n; i++) w[i] = once(o, e, bwd, i, &wrong);
    qsort(w, n, sizeof *w, cmp_double);
    med = w[n / 2];
    free(w);
    MPI_Allreduce(MPI_IN_PLACE, &med, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    double want = med > 0 ? o->duration / med : o->max_iters;
    int iters = want < o->min_iters ? o->min_iters : want > o->max_iters ? o->max_iters : (int)want;

    double *t = malloc(sizeof(double) * iters);
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < iters; i++) t[i] = once(o, e, bwd, n + i, &wrong);
    MPI_Reduce(e->rank == 0 ? MPI_IN_PLACE : t, t, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (e->rank == 0) {
        long side = o->L > o->R ? o->L : o->R;
        long count = o->outer * side * o->inner;
        qsort(t, iters, sizeof *t, cmp_double);
        double p50 = quantile(t, iters, 0.5) * 1e6, p99 = quantile(t, iters, 0.99) * 1e6;
        printf("%12ld %12ld %9s %4s %8d %9.2f %9.2f %10.3f %6ld\n", count * 4, count, "float32", bwd ? "bwd" : "fwd",
               iters, p50, p99, count * 4 / (p50 * 1e3), o->check ? wrong : -1);
        fflush(stdout);
    }
    free(t);
    return wrong;
}

static long parse_long(const char *flag, const char *v) {
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < 0) {
        fprintf(stderr, "mpi_halo: %s %s: not a size\n", flag, v);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    return x;
}

static options parse(int argc, char **argv) {
    options o = {1, 1, 512, 1, 1, 1, 1, 100, 200, 1000000, 0, 2.0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--check")) {
            o.check = 1;
            continue;
        }
        if (v == NULL) die("every option but --check takes a value (see the comment at the top of bench/mpi_halo.c)");
        i++;
        if (!strcmp(a, "--bytes")) {
            long b = parse_long(a, v);
            if (b < 4 || b % 4) die("--bytes: a positive multiple of 4 (float32)");
            o.outer = o.slices = 1, o.inner = b / 4, o.L = o.R = 1;
        } else if (!strcmp(a, "--shape")) {
            if (sscanf(v, "%ldx%ldx%ld", &o.outer, &o.slices, &o.inner) != 3 || o.outer < 1 || o.slices < 1 || o.inner < 1)
                die("--shape: OUTERxSLICESxINNER, all positive");
        } else if (!strcmp(a, "--left")) o.L = parse_long(a, v);
        else if (!strcmp(a, "--right")) o.R = parse_long(a, v);
        else if (!strcmp(a, "--op")) {
            o.fwd = !strcmp(v, "fwd") || !strcmp(v, "both");
            o.bwd = !strcmp(v, "bwd") || !strcmp(v, "both");
            if (!o.fwd && !o.bwd) die("--op: fwd, bwd or both");
        } else if (!strcmp(a, "--warmup")) o.warmup = (int)parse_long(a, v);
        else if (!strcmp(a, "--duration")) o.duration = atof(v);
        else if (!strcmp(a, "--min-iters")) o.min_iters = (int)parse_long(a, v);
        else if (!strcmp(a, "--max-iters")) o.max_iters = (int)parse_long(a, v);
        else die("unknown option (see the comment at the top of bench/mpi_halo.c)");
    }
    if (o.L > o.slices || o.R > o.slices) die("--left and --right may not exceed the shard's slices");
    if (o.min_iters < 1 || o.max_iters < o.min_iters) die("--min-iters must be at least 1 and at most --max-iters");
    return o;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    options o = parse(argc, argv);
    exchange e;
    MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &e.size);
    e.left  = e.rank > 0 ? e.rank - 1 : MPI_PROC_NULL;
    e.right = e.rank < e.size - 1 ? e.rank + 1 : MPI_PROC_NULL;
    e.P     = o.L + o.slices + o.R;
    size_t n = (size_t)o.outer * e.P * o.inner;
    e.out  = calloc(n, sizeof(float));
    e.grad = calloc(n, sizeof(float));
    e.from_left  = calloc((size_t)o.outer * (o.R ? o.R : 1) * o.inner, sizeof(float));
    e.from_right = calloc((size_t)o.outer * (o.L ? o.L : 1) * o.inner, sizeof(float));
    if (!e.out || !e.grad || !e.from_left || !e.from_right) die("out of memory");
    MPI_Type_vector((int)o.outer, (int)(o.L * o.inner), (int)(e.P * o.inner), MPI_FLOAT, &e.slab_l);
    MPI_Type_vector((int)o.outer, (int)(o.R * o.inner), (int)(e.P * o.inner), MPI_FLOAT, &e.slab_r);
    MPI_Type_commit(&e.slab_l);
    MPI_Type_commit(&e.slab_r);

    if (e.rank == 0) {
        char lib[MPI_MAX_LIBRARY_VERSION_STRING];
        int len;
        MPI_Get_library_version(lib, &len);
        lib[strcspn(lib, ",\n")] = '\0';
        printf("# mpi_halo: %s, %d ranks, shard %ldx%ldx%ld float32, halos %ld+%ld slices, in place\n", lib, e.size,
               o.outer, o.slices, o.inner, o.L, o.R);
        printf("# %10s %12s %9s %4s %8s %9s %9s %10s %6s\n", "size", "count", "type", "op", "iters", "p50", "p99", "algbw", "#wrong");
        printf("# %10s %12s %9s %4s %8s %9s %9s %10s %6s\n", "(B)", "(elements)", "", "", "", "(us)", "(us)", "(GB/s)", "");
    }
    long wrong = 0;
    if (o.fwd) wrong += run(&o, &e, 0);
    if (o.bwd) wrong += run(&o, &e, 1);
    MPI_Type_free(&e.slab_l);
    MPI_Type_free(&e.slab_r);
    free(e.out), free(e.grad), free(e.from_left), free(e.from_right);
    MPI_Finalize();
    return wrong ? 3 : 0;
}
