/* Forward and backward across W real processes, checked bit for bit against
 * an oracle computed from the whole global tensor. Cases: every dim of 3-D
 * and 5-D tensors; halos 0, 1, 2 and longer than a shard; uneven and empty
 * shards; contiguous, non-contiguous and in-place (x inside out) layouts;
 * float32, float64, float16, bfloat16; each through the blocking calls, the
 * asynchronous ones (start, test, wait) and a halos-only plan (left and right
 * tensors of their own, grad_x added to), in turn; every padding mode, its
 * halos shortened to what the mode allows for the global length (the oracle
 * is F.pad of the global tensor and torch's backward order, halo.h).
 *
 *   test_exchange W [--external]    launch W ranks (rendezvous, or addresses
 *                                   exchanged through files by the caller) */
#include "launch.h"
#include "values.h"

enum { BLOCKING, ASYNC, HALOS, HALOS_ASYNC, NMODES };

typedef struct {
    int id, nd, dim, dtype, layout; /* layout: 0 contiguous, 1 strided, 2 in place */
    int mode;                       /* BLOCKING, ASYNC, HALOS or HALOS_ASYNC */
    int pad;                        /* halo_padding_t */
    int64_t shape[8], L, R, len[64], off[65];
} tcase;

static int64_t numel(int nd, const int64_t *s) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= s[i];
    return n;
}

static void unravel(int nd, const int64_t *shape, int64_t i, int64_t *idx) {
    for (int d = nd - 1; d >= 0; d--) {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
}

static int64_t dot(int nd, const int64_t *idx, const int64_t *st) {
    int64_t o = 0;
    for (int d = 0; d < nd; d++) o += idx[d] * st[d];
    return o;
}

static void contiguous(int nd, const int64_t *shape, int64_t *st) {
    int64_t acc = 1;
    for (int d = nd - 1; d >= 0; d--) { st[d] = acc; acc *= shape[d]; }
}

/* Strides in a rotated dimension order with a gap: non-contiguous. */
static void strided(int nd, const int64_t *shape, int seed, int64_t *st) {
    int64_t acc = 1 + seed % 2;
    for (int k = 0; k < nd; k++) {
        int d = (k + seed) % nd;
        st[d] = acc;
        acc *= shape[d] + 1;
    }
}

static int64_t extent(int nd, const int64_t *shape, const int64_t *st) {
    int64_t last = 0;
    for (int d = 0; d < nd; d++) {
        if (shape[d] == 0) return 0;
        last += (shape[d] - 1) * st[d];
    }
    return last + 1;
}

/* Global key of element idx of the global tensor (position P along dim). */
static uint64_t x_key(const tcase *c, const int64_t *idx, int64_t P) {
    uint64_t k = (uint64_t)c->id * 0x100000001b3ull;
    for (int d = 0; d < c->nd; d++) k = k * 131 + (uint64_t)(d == c->dim ? P : idx[d]);
    return k;
}

static uint64_t g_key(const tcase *c, int s, const int64_t *idx) {
    uint64_t k = (uint64_t)c->id * 0x100000001b3ull + 0x5555 + (uint64_t)s * 7919;
    for (int d = 0; d < c->nd; d++) k = k * 137 + (uint64_t)idx[d];
    return ~k;
}

static uint64_t gout_value(const tcase *c, int s, const int64_t *idx_out) {
    return value_bits(c->dtype, g_key(c, s, idx_out));
}

/* Finishes an exchange begun by a start call: a few tests, then a wait. */
static void finish(halo_plan_t plan, halo_direction_t dir, int id) {
    int done = 0;
    for (int i = 0; i < id % 4 && !done; i++) HALO_OK(halo_plan_test(plan, dir, &done));
    if (!done) HALO_OK(halo_plan_wait(plan, dir));
    int again;
    CHECK(halo_plan_wait(plan, dir) == HALO_ERR_INVALID_STATE, "a second wait after the exchange finished was not refused");
    CHECK(halo_plan_test(plan, dir, &again) == HALO_ERR_INVALID_STATE, "a test after the exchange finished was not refused");
}

/* Where element idx of the padded output lives: out, or for a halos-only
 * plan left, x's place (returned NULL: the caller's own) or right. */
typedef struct {
    unsigned char *base[3]; /* left or out, (unused), right */
    const int64_t *st[3];
    int64_t L, n;
    int dim, nd, halos;
} padded_view;

static unsigned char *padded_at(const padded_view *v, const int64_t *idx_out, int es) {
    int64_t j[8];
    memcpy(j, idx_out, sizeof j);
    if (!v->halos) return v->base[0] + dot(v->nd, j, v->st[0]) * es;
    if (j[v->dim] < v->L) return v->base[0] + dot(v->nd, j, v->st[0]) * es;
    if (j[v->dim] >= v->L + v->n) {
        j[v->dim] -= v->L + v->n;
        return v->base[2] + dot(v->nd, j, v->st[2]) * es;
    }
    return NULL;
}

/* One layout of an exchange under test: its tensors, the plan parameters
 * that describe them, and where each padded element lives. */
typedef struct {
    const tcase *c;
    int es, halos;
    int64_t n;
    int64_t xs[8], os[8], xst[8], ost[8], gost[8], gxst[8];
    int64_t ls[8], rs[8], lst[8], rst[8], glst[8], grst[8];
    halo_plan_params_t p;
    unsigned char *x, *out, *gout, *gx, *left, *right, *gleft, *gright;
    padded_view ov, gov;
} lrun;

static unsigned char *alloc_tensor(int nd, const int64_t *shape, const int64_t *st, int es) {
    size_t bytes = (size_t)(extent(nd, shape, st) + 1) * es;
    unsigned char *b = malloc(bytes);
    memset(b, 0xA5, bytes); /* garbage where the plan must write */
    return b;
}

/* Lays out the tensors of case c on this rank and stores x. */
static void lrun_setup(lrun *l, const tcase *c) {
    int r = g_rank, nd = c->nd, dim = c->dim;
    memset(l, 0, sizeof *l);
    l->c = c;
    l->es = dtype_size(c->dtype);
    l->n = c->len[r];
    l->halos = c->mode >= HALOS;
    int64_t L = c->L, R = c->R, n = l->n;
    memcpy(l->xs, c->shape, sizeof l->xs);
    l->xs[dim] = n;
    memcpy(l->os, l->xs, sizeof l->os);
    l->os[dim] = n + L + R;
    contiguous(nd, l->xs, l->xst);
    contiguous(nd, l->os, l->ost);
    memcpy(l->gost, l->ost, sizeof l->gost);
    memcpy(l->gxst, l->xst, sizeof l->gxst);
    if (c->layout == 1) {
        strided(nd, l->xs, c->id, l->xst);
        strided(nd, l->os, c->id + 1, l->ost);
        strided(nd, l->os, c->id + 2, l->gost);
        strided(nd, l->xs, c->id + 3, l->gxst);
    } else if (c->layout == 2 && !l->halos) {
        strided(nd, l->os, c->id, l->ost);
        memcpy(l->xst, l->ost, sizeof l->xst);
        memcpy(l->gost, l->ost, sizeof l->gost);
        memcpy(l->gxst, l->ost, sizeof l->gxst);
    }
    memcpy(l->ls, l->xs, sizeof l->ls);
    memcpy(l->rs, l->xs, sizeof l->rs);
    l->ls[dim] = L;
    l->rs[dim] = R;
    contiguous(nd, l->ls, l->lst);
    contiguous(nd, l->rs, l->rst);
    contiguous(nd, l->ls, l->glst);
    contiguous(nd, l->rs, l->grst);
    if (l->halos && c->layout == 1) {
        strided(nd, l->ls, c->id + 4, l->lst);
        strided(nd, l->rs, c->id + 5, l->rst);
        strided(nd, l->ls, c->id + 6, l->glst);
    }
    halo_plan_params_t *p = &l->p;
    p->dtype = (halo_dtype_t)c->dtype;
    p->ndim = nd;
    p->shape = l->xs;
    p->dim = dim;
    p->left = L;
    p->right = R;
    p->padding = (halo_padding_t)c->pad;
    p->field_mask = HALO_PLAN_PARAM_X_STRIDES | HALO_PLAN_PARAM_GRAD_X_STRIDES | HALO_PLAN_PARAM_PADDING;
    p->x_strides = l->xst;
    p->grad_x_strides = l->gxst;
    if (l->halos) {
        p->field_mask |= HALO_PLAN_PARAM_HALOS_ONLY | HALO_PLAN_PARAM_LEFT_STRIDES | HALO_PLAN_PARAM_RIGHT_STRIDES |
                         HALO_PLAN_PARAM_GRAD_LEFT_STRIDES | HALO_PLAN_PARAM_GRAD_RIGHT_STRIDES;
        p->halos_only = 1;
        p->left_strides = l->lst;
        p->right_strides = l->rst;
        p->grad_left_strides = l->glst;
        p->grad_right_strides = l->grst;
    } else {
        p->field_mask |= HALO_PLAN_PARAM_OUT_STRIDES | HALO_PLAN_PARAM_GRAD_OUT_STRIDES;
        p->out_strides = l->ost;
        p->grad_out_strides = l->gost;
    }
    int es = l->es;
    l->out = alloc_tensor(nd, l->os, l->ost, es);
    l->gout = alloc_tensor(nd, l->os, l->gost, es);
    l->left = alloc_tensor(nd, l->ls, l->lst, es);
    l->right = alloc_tensor(nd, l->rs, l->rst, es);
    l->gleft = alloc_tensor(nd, l->ls, l->glst, es);
    l->gright = alloc_tensor(nd, l->rs, l->grst, es);
    if (c->layout == 2 && !l->halos) {
        l->x = l->out + L * l->ost[dim] * es;
        l->gx = l->gout + L * l->gost[dim] * es;
    } else {
        l->x = alloc_tensor(nd, l->xs, l->xst, es);
        l->gx = alloc_tensor(nd, l->xs, l->gxst, es);
    }
    l->ov = (padded_view){{l->out, NULL, NULL}, {l->ost, NULL, NULL}, L, n, dim, nd, 0};
    l->gov = (padded_view){{l->gout, NULL, NULL}, {l->gost, NULL, NULL}, L, n, dim, nd, 0};
    if (l->halos) {
        l->ov = (padded_view){{l->left, NULL, l->right}, {l->lst, NULL, l->rst}, L, n, dim, nd, 1};
        l->gov = (padded_view){{l->gleft, NULL, l->gright}, {l->glst, NULL, l->grst}, L, n, dim, nd, 1};
    }
    int64_t idx[8];
    for (int64_t i = 0; i < numel(nd, l->xs); i++) {
        unravel(nd, l->xs, i, idx);
        put_bits(l->x + dot(nd, idx, l->xst) * es, es, value_bits(c->dtype, x_key(c, idx, c->off[r] + idx[dim])));
    }
}

/* The global slice that global position g of the padded sequence shows. */
static int64_t pad_source(int pad, int64_t g, int64_t N) {
    if (g >= 0 && g < N) return g;
    switch (pad) {
    case HALO_PAD_REPLICATE: return g < 0 ? 0 : N - 1;
    case HALO_PAD_REFLECT: return g < 0 ? -g : 2 * (N - 1) - g;
    case HALO_PAD_CIRCULAR: return g < 0 ? g + N : g - N;
    }
    return -1; /* zeros */
}

static void lrun_check_out(const lrun *l, int *bad) {
    const tcase *c = l->c;
    int r = g_rank, nd = c->nd, dim = c->dim, es = l->es;
    int64_t idx[8], N = c->off[g_world];
    for (int64_t i = 0; i < numel(nd, l->os) && *bad < 3; i++) {
        unravel(nd, l->os, i, idx);
        int64_t P = pad_source(c->pad, c->off[r] - c->L + idx[dim], N);
        uint64_t want = P >= 0 ? value_bits(c->dtype, x_key(c, idx, P)) : 0;
        unsigned char *at = padded_at(&l->ov, idx, es);
        if (at == NULL) continue; /* x itself, in a halos-only plan */
        uint64_t got = get_bits(at, es);
        if (got != want) {
            CHECK(0, "case %d (nd %d dim %d L %ld R %ld dtype %d layout %d mode %d pad %d): out[%ld] pos %ld = %#lx, want %#lx", c->id, nd,
                  dim, (long)c->L, (long)c->R, c->dtype, c->layout, c->mode, c->pad, (long)i, (long)idx[dim], (unsigned long)got,
                  (unsigned long)want);
            (*bad)++;
        }
    }
}

/* Stores grad_out: in the padded tensor, or for a halos-only plan in the
 * halo gradients and (its interior) in grad_x. */
static void lrun_fill_grad(const lrun *l) {
    const tcase *c = l->c;
    int nd = c->nd, dim = c->dim, es = l->es;
    int64_t idx[8], gidx[8];
    for (int64_t i = 0; i < numel(nd, l->os); i++) {
        unravel(nd, l->os, i, idx);
        unsigned char *at = padded_at(&l->gov, idx, es);
        if (at == NULL) {
            memcpy(gidx, idx, sizeof gidx);
            gidx[dim] -= c->L;
            at = l->gx + dot(nd, gidx, l->gxst) * es;
        }
        put_bits(at, es, gout_value(c, g_rank, idx));
    }
}

/* The gathered padded gradient at global position g (other coordinates
 * idx's): the sum of the ranks' grad_out there, the owner's own first, then
 * the ranks to its right nearest first, then those to its left; beyond the
 * ends, the ranks nearest the end first. */
static uint64_t gathered_grad(const tcase *c, int64_t g, const int64_t *idx) {
    int W = g_world, order[64], k = 0, o = 0;
    int64_t N = c->off[W], gidx[8];
    if (g < 0) {
        for (int s = 0; s < W; s++) order[k++] = s;
    } else if (g >= N) {
        for (int s = W - 1; s >= 0; s--) order[k++] = s;
    } else {
        while (!(g >= c->off[o] && g < c->off[o + 1])) o++;
        order[k++] = o;
        for (int s = o + 1; s < W; s++) order[k++] = s;
        for (int s = o - 1; s >= 0; s--) order[k++] = s;
    }
    uint64_t v = 0;
    int first = 1;
    memcpy(gidx, idx, sizeof gidx);
    for (int i = 0; i < k; i++) {
        int s = order[i];
        if (g < c->off[s] - c->L || g >= c->off[s + 1] + c->R) continue;
        gidx[c->dim] = g - c->off[s] + c->L;
        uint64_t gs = gout_value(c, s, gidx);
        v = first ? gs : add_bits(c->dtype, v, gs);
        first = 0;
    }
    return v;
}

/* grad_x at global slice P under a padding mode other than zeros: torch's
 * F.pad backward of the gathered gradient. Replicate and reflect: from +0,
 * every position showing P in increasing order. Circular: P's own gradient,
 * then the backward of the right copy (its slots at their sources, zero
 * elsewhere), then the left copy's likewise. */
static uint64_t padded_grad(const tcase *c, int64_t P, const int64_t *idx) {
    int64_t N = c->off[g_world];
    uint64_t v = 0;
    if (c->pad == HALO_PAD_CIRCULAR) {
        v = gathered_grad(c, P, idx);
        if (c->R > 0) v = add_bits(c->dtype, v, P < c->R ? gathered_grad(c, P + N, idx) : 0);
        if (c->L > 0) v = add_bits(c->dtype, v, P >= N - c->L ? gathered_grad(c, P - N, idx) : 0);
        /* torch (1.13 and 2.x) adds +0 to every slice when the halos
         * together are longer than the sequence (halo/testdata/circular_zeros.json). */
        if (c->L + c->R > N) v = add_bits(c->dtype, v, 0);
        return v;
    }
    for (int64_t g = -c->L; g < N + c->R; g++)
        if (pad_source(c->pad, g, N) == P) v = add_bits(c->dtype, v, gathered_grad(c, g, idx));
    return v;
}

/* grad_x at global slice P = off[r] + j under zeros: the reference's order
 * (the owner's own, the right neighbours' then the left neighbours' halo
 * gradients, nearest first, with the edge ranks' +0). */
static uint64_t zeros_grad(const tcase *c, int r, int64_t n, const int64_t *idx) {
    int W = g_world, dim = c->dim;
    int64_t L = c->L, R = c->R, j = idx[dim], P = c->off[r] + j, gidx[8];
    memcpy(gidx, idx, sizeof gidx);
    gidx[dim] = j + L;
    uint64_t v = gout_value(c, r, gidx);
    for (int s = r + 1; s < W; s++)
        if (P >= c->off[s] - L && P < c->off[s]) {
            gidx[dim] = P - c->off[s] + L;
            v = add_bits(c->dtype, v, gout_value(c, s, gidx));
        }
    if (r == W - 1 && j >= n - L) v = add_bits(c->dtype, v, 0);
    for (int s = r - 1; s >= 0; s--)
        if (P >= c->off[s + 1] && P < c->off[s + 1] + R) {
            gidx[dim] = P - c->off[s] + L;
            v = add_bits(c->dtype, v, gout_value(c, s, gidx));
        }
    if (r == 0 && j < R) v = add_bits(c->dtype, v, 0);
    return v;
}

static void lrun_check_gx(const lrun *l, int *bad) {
    const tcase *c = l->c;
    int r = g_rank, nd = c->nd, dim = c->dim, es = l->es;
    int64_t idx[8];
    for (int64_t i = 0; i < numel(nd, l->xs) && *bad < 3; i++) {
        unravel(nd, l->xs, i, idx);
        int64_t j = idx[dim];
        uint64_t v = c->pad == HALO_PAD_ZEROS ? zeros_grad(c, r, l->n, idx) : padded_grad(c, c->off[r] + j, idx);
        uint64_t got = get_bits(l->gx + dot(nd, idx, l->gxst) * es, es);
        if (got != v) {
            CHECK(0, "case %d (nd %d dim %d L %ld R %ld dtype %d layout %d mode %d pad %d): grad_x[%ld] pos %ld = %#lx, want %#lx", c->id,
                  nd, dim, (long)c->L, (long)c->R, c->dtype, c->layout, c->mode, c->pad, (long)i, (long)j, (unsigned long)got,
                  (unsigned long)v);
            (*bad)++;
        }
    }
}

static void lrun_free(lrun *l) {
    if (l->c->layout != 2 || l->halos) {
        free(l->x);
        free(l->gx);
    }
    free(l->out);
    free(l->gout);
    free(l->left);
    free(l->right);
    free(l->gleft);
    free(l->gright);
}

static void run_case(halo_comm_t comm, const tcase *c) {
    lrun l;
    lrun_setup(&l, c);
    halo_plan_t plan;
    HALO_OK(halo_plan_create(comm, &l.p, &plan));
    switch (c->mode) {
    case BLOCKING: HALO_OK(halo_plan_forward(plan, l.x, l.out)); break;
    case ASYNC: HALO_OK(halo_plan_forward_start(plan, l.x, l.out)); finish(plan, HALO_DIR_FORWARD, c->id); break;
    case HALOS: HALO_OK(halo_plan_halos_forward(plan, l.x, l.left, l.right)); break;
    default: HALO_OK(halo_plan_halos_forward_start(plan, l.x, l.left, l.right)); finish(plan, HALO_DIR_FORWARD, c->id);
    }
    int bad = 0;
    lrun_check_out(&l, &bad);
    lrun_fill_grad(&l);
    switch (c->mode) {
    case BLOCKING: HALO_OK(halo_plan_backward(plan, l.gout, l.gx)); break;
    case ASYNC: HALO_OK(halo_plan_backward_start(plan, l.gout, l.gx)); finish(plan, HALO_DIR_BACKWARD, c->id); break;
    case HALOS: HALO_OK(halo_plan_halos_backward(plan, l.gleft, l.gright, l.gx)); break;
    default: HALO_OK(halo_plan_halos_backward_start(plan, l.gleft, l.gright, l.gx)); finish(plan, HALO_DIR_BACKWARD, c->id);
    }
    lrun_check_gx(&l, &bad);
    HALO_OK(halo_plan_destroy(plan));
    lrun_free(&l);
}

/* K cases as one multi-layout plan (all padded or all halos-only, blocking
 * or asynchronous, as cs[0].mode says). */
static void run_multi(halo_comm_t comm, const tcase *cs, int K) {
    lrun l[8];
    halo_plan_params_t ps[8];
    const void *a[8];
    void *b[8], *c[8];
    for (int k = 0; k < K; k++) {
        lrun_setup(&l[k], &cs[k]);
        ps[k] = l[k].p;
    }
    int mode = cs[0].mode, halos = l[0].halos, async = mode == ASYNC || mode == HALOS_ASYNC;
    halo_plan_t plan;
    HALO_OK(halo_plan_create_multi(comm, K, ps, &plan));
    for (int k = 0; k < K; k++) {
        a[k] = l[k].x;
        b[k] = halos ? l[k].left : l[k].out;
        c[k] = l[k].right;
    }
    if (halos) HALO_OK((async ? halo_plan_halos_forward_multi_start : halo_plan_halos_forward_multi)(plan, a, b, c));
    else HALO_OK((async ? halo_plan_forward_multi_start : halo_plan_forward_multi)(plan, a, b));
    if (async) finish(plan, HALO_DIR_FORWARD, cs[0].id);
    int bad = 0;
    for (int k = 0; k < K; k++) {
        lrun_check_out(&l[k], &bad);
        lrun_fill_grad(&l[k]);
        a[k] = halos ? l[k].gleft : l[k].gout;
        b[k] = halos ? l[k].gright : l[k].gx;
        c[k] = l[k].gx;
    }
    if (halos) HALO_OK((async ? halo_plan_halos_backward_multi_start : halo_plan_halos_backward_multi)(plan, a, (const void *const *)b, c));
    else HALO_OK((async ? halo_plan_backward_multi_start : halo_plan_backward_multi)(plan, a, b));
    if (async) finish(plan, HALO_DIR_BACKWARD, cs[0].id);
    for (int k = 0; k < K; k++) {
        lrun_check_gx(&l[k], &bad);
        lrun_free(&l[k]);
    }
    HALO_OK(halo_plan_destroy(plan));
}

static int run_rank(halo_comm_t comm) {
    static const int64_t halos[][2] = {{0, 0}, {1, 0}, {0, 2}, {1, 1}, {2, 2}, {5, 3}};
    int ncase = 0;
    for (int nd = 3; nd <= 5; nd += 2)
        for (int dim = 0; dim < nd; dim++)
            for (int h = 0; h < 6; h++)
                for (int layout = 0; layout < 3; layout++) {
                    tcase c;
                    memset(&c, 0, sizeof c);
                    c.id = ncase++;
                    c.nd = nd;
                    c.dim = dim;
                    c.layout = layout;
                    c.mode = (c.id / 3) % NMODES;
                    c.dtype = (c.id + layout) % 4;
                    c.L = halos[h][0];
                    c.R = halos[h][1];
                    for (int d = 0; d < nd; d++) c.shape[d] = 1 + (d + c.id) % 3;
                    for (int s = 0; s < g_world; s++) {
                        c.len[s] = 2 + (s * 7 + c.id) % 3;   /* uneven: 2..4 */
                        if (g_world > 2 && s == 1 && c.id % 5 == 0) c.len[s] = 0; /* an empty shard */
                        if (g_world > 1 && s == g_world - 1 && c.id % 7 == 0) c.len[s] = 1;
                        c.off[s + 1] = c.off[s] + c.len[s];
                    }
                    /* Every mode in turn, the halos as long as it allows. */
                    int64_t N = c.off[g_world];
                    c.pad = (c.id / 12) % 4;
                    if (c.pad == HALO_PAD_REFLECT) { if (c.L >= N) c.L = N - 1; if (c.R >= N) c.R = N - 1; }
                    if (c.pad == HALO_PAD_CIRCULAR) { if (c.L > N) c.L = N; if (c.R > N) c.R = N; }
                    run_case(comm, &c);
                    /* Every third case also travels with the two before it,
                     * as one plan of three layouts. */
                    static tcase prev[3];
                    prev[ncase % 3] = c;
                    if (ncase % 3 == 0) {
                        for (int k = 0; k < 3; k++) prev[k].mode = c.mode;
                        run_multi(comm, prev, 3);
                    }
                }
    return ncase;
}

/* External bootstrap: ranks exchange addresses through files in a folder. */
static halo_comm_t external_comm(const char *dir) {
    halo_comm_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = HALO_COMM_PARAM_BOOTSTRAP | HALO_COMM_PARAM_TIMEOUT;
    p.bootstrap = HALO_BOOTSTRAP_EXTERNAL;
    p.timeout_ms = 20000;
    halo_comm_t c;
    HALO_OK(halo_comm_create(g_rank, g_world, &p, &c));
    const void *addr;
    size_t len;
    HALO_OK(halo_comm_get_address(c, &addr, &len));
    char path[512], tmp[512];
    snprintf(tmp, sizeof tmp, "%s/%d.tmp", dir, g_rank);
    snprintf(path, sizeof path, "%s/%d.addr", dir, g_rank);
    FILE *f = fopen(tmp, "wb");
    fwrite(addr, 1, len, f);
    fclose(f);
    rename(tmp, path);
    void *addrs[64];
    size_t lens[64];
    for (int s = 0; s < g_world; s++) {
        snprintf(path, sizeof path, "%s/%d.addr", dir, s);
        double deadline = now_s() + 30;
        while (!(f = fopen(path, "rb"))) {
            if (now_s() > deadline) { fprintf(stderr, "rank %d: no address from rank %d\n", g_rank, s); exit(1); }
            usleep(5000);
        }
        addrs[s] = malloc(1 << 16);
        lens[s] = fread(addrs[s], 1, 1 << 16, f);
        fclose(f);
    }
    HALO_OK(halo_comm_connect(c, (const void *const *)addrs, lens));
    for (int s = 0; s < g_world; s++) free(addrs[s]);
    return c;
}

int main(int argc, char **argv) {
    int port = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!rank_args(argc, argv, &port)) {
        int W = argc > 1 ? atoi(argv[1]) : 2;
        if (W < 1 || W > 64) { fprintf(stderr, "usage: %s W [--external]\n", argv[0]); return 2; }
        char dir[] = "/tmp/halo-test-XXXXXX";
        char *extra[2] = {"--dir", dir};
        int external = has_flag(argc, argv, "--external");
        if (external && !mkdtemp(dir)) { perror("mkdtemp"); return 2; }
        double t0 = now_s();
        int bad = launch(argv[0], W, 600, NULL, external ? 2 : 0, extra);
        if (external) {
            char cmd[600];
            snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
            if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
        }
        printf("test_exchange W=%d%s: %s (%.1f s)\n", W, external ? " external bootstrap" : "", bad ? "FAILED" : "passed", now_s() - t0);
        return bad ? 1 : 0;
    }
    halo_comm_t comm;
    if (has_flag(argc, argv, "--dir")) {
        const char *dir = NULL;
        for (int i = 1; i + 1 < argc; i++) if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
        comm = external_comm(dir);
    } else {
        comm = make_comm(port, 20000);
    }
    int n = run_rank(comm);
    HALO_OK(halo_comm_destroy(comm));
    if (g_rank == 0) printf("rank 0: %d cases checked, %d failures\n", n, g_failures);
    return g_failures ? 1 : 0;
}
