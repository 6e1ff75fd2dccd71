/*
 * C helpers of package ucx; see helpers.h. Every loop that polls UCX lives
 * here so that Go crosses into C once per Post and once per Wait.
 */
#define _GNU_SOURCE
#include "helpers.h"

#include <ucs/debug/log_def.h>

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Polls between two looks at the clock (and at requests that might have
 * completed without the progress call reporting an event). A poll of an idle
 * shared-memory worker costs tens of nanoseconds, so this is a few
 * microseconds of deadline resolution. */
#define HUX_CLOCK_EVERY 256

static inline int64_t hux_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The end of a timeout that starts at now; a negative one never ends. */
static inline int64_t hux_end_at(int64_t now, int64_t timeout_ns)
{
    return (timeout_ns < 0) ? INT64_MAX : now + timeout_ns;
}

static inline int64_t hux_end_ns(int64_t timeout_ns)
{
    return (timeout_ns < 0) ? INT64_MAX : hux_end_at(hux_now_ns(), timeout_ns);
}

/* ---- signals ---------------------------------------------------------- */

typedef int (*hux_sigaction_fn)(int, const struct sigaction *,
                                struct sigaction *);

/* libc's own sigaction: libucs_signal (UCX's optional preload) interposes
 * sigaction and silently refuses to replace UCX's error handlers. */
static hux_sigaction_fn hux_libc_sigaction(void)
{
    hux_sigaction_fn fn = NULL;
    void *libc;

    libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    if (libc != NULL) {
        fn = (hux_sigaction_fn)dlsym(libc, "sigaction");
        dlclose(libc);
    }
    return (fn != NULL) ? fn : sigaction;
}

static void *hux_handler(const struct sigaction *sa)
{
    return (sa->sa_flags & SA_SIGINFO) ? (void*)sa->sa_sigaction :
                                         (void*)sa->sa_handler;
}

static int hux_handler_in_libucs(const struct sigaction *sa)
{
    const char *base;
    void *handler = hux_handler(sa);
    Dl_info info;

    if ((handler == (void*)SIG_DFL) || (handler == (void*)SIG_IGN) ||
        !dladdr(handler, &info) || (info.dli_fname == NULL)) {
        return 0;
    }
    base = strrchr(info.dli_fname, '/');
    base = (base != NULL) ? base + 1 : info.dli_fname;
    return strncmp(base, "libucs", 6) == 0;
}

/*
 * Give the signals that Go turns into panics back to Go where UCX's error
 * handler holds them. SIGURG (Go's preemption signal) carries the Go runtime's
 * handler in every build mode, so its action is the one to copy. UCX's record
 * of the original action is left alone: if C code faults, Go forwards the
 * signal to UCX's handler, which prints its backtrace and restores defaults.
 * Returns how many handlers were replaced, or -1 if Go's was not found.
 */
int hux_reclaim_signals(void)
{
    static const int sigs[] = {SIGSEGV, SIGBUS, SIGFPE};
    hux_sigaction_fn real = hux_libc_sigaction();
    struct sigaction go, cur;
    void *go_handler;
    size_t i;
    int n = 0;

    if (real(SIGURG, NULL, &go) != 0) {
        return -1;
    }
    go_handler = hux_handler(&go);
    if ((go_handler == (void*)SIG_DFL) || (go_handler == (void*)SIG_IGN) ||
        hux_handler_in_libucs(&go)) {
        return -1;
    }
    for (i = 0; i < sizeof(sigs) / sizeof(sigs[0]); ++i) {
        if ((real(sigs[i], NULL, &cur) == 0) && hux_handler_in_libucs(&cur) &&
            (real(sigs[i], &go, NULL) == 0)) {
            ++n;
        }
    }
    return n;
}

/*
 * SIGINT during a long wait. A caller that handles SIGINT itself (Python's
 * handler only sets a flag that its interpreter reads once the C call
 * returns) would otherwise see Ctrl-C only at the deadline. Once a wait has
 * lasted HUX_SIGINT_AFTER_NS, a handler of ours sits in front of the
 * caller's: it counts the signal and calls the caller's handler as before;
 * the wait sees the count change and ends, aborting the transport. Only then:
 * short waits (every exchange that is not stuck) never pay the two
 * sigaction calls, and a process whose SIGINT is SIG_DFL (dies at once) or
 * SIG_IGN (wants no interruption) is left alone.
 */
#define HUX_SIGINT_AFTER_NS  (10 * 1000000LL)
/* How long an armed wait sleeps at most between looks at the count: the
 * signal may be delivered to another thread than the waiting one, whose
 * ppoll it then does not interrupt. */
#define HUX_SIGINT_SLICE_NS  (100 * 1000000LL)

static pthread_mutex_t  hux_sigint_mu = PTHREAD_MUTEX_INITIALIZER;
static int              hux_sigint_users;   /* armed waits; under the mutex */
static struct sigaction hux_sigint_prev;    /* the caller's action */
static unsigned         hux_sigint_count;   /* SIGINTs seen while armed */

static void hux_sigint_handler(int sig, siginfo_t *info, void *ctx)
{
    int saved = errno;

    __atomic_add_fetch(&hux_sigint_count, 1, __ATOMIC_RELEASE);
    if (hux_sigint_prev.sa_flags & SA_SIGINFO) {
        hux_sigint_prev.sa_sigaction(sig, info, ctx);
    } else if ((hux_sigint_prev.sa_handler != SIG_DFL) &&
               (hux_sigint_prev.sa_handler != SIG_IGN)) {
        hux_sigint_prev.sa_handler(sig);
    }
    errno = saved;
}

/* Puts our handler in front of the caller's if the caller has one. Returns
 * 1 (armed: *seen is the count now) or 0. */
static int hux_sigint_arm(unsigned *seen)
{
    hux_sigaction_fn real = hux_libc_sigaction();
    struct sigaction cur, ours;
    void *h;
    int armed = 1;

    pthread_mutex_lock(&hux_sigint_mu);
    if (hux_sigint_users == 0) {
        h = (real(SIGINT, NULL, &cur) == 0) ? hux_handler(&cur) : (void*)SIG_DFL;
        if ((h == (void*)SIG_DFL) || (h == (void*)SIG_IGN) ||
            (h == (void*)hux_sigint_handler)) {
            armed = 0;
        } else {
            hux_sigint_prev = cur;
            ours            = cur;
            ours.sa_sigaction = hux_sigint_handler;
            /* SA_ONSTACK: it may run on a Go thread's small stack. */
            ours.sa_flags   = (cur.sa_flags | SA_SIGINFO | SA_ONSTACK) &
                              ~SA_RESETHAND;
            armed = (real(SIGINT, &ours, NULL) == 0);
        }
    }
    if (armed) {
        ++hux_sigint_users;
        *seen = __atomic_load_n(&hux_sigint_count, __ATOMIC_ACQUIRE);
    }
    pthread_mutex_unlock(&hux_sigint_mu);
    return armed;
}

/* Gives SIGINT back to the caller's handler after the last armed wait,
 * unless someone replaced ours meanwhile. */
static void hux_sigint_disarm(void)
{
    hux_sigaction_fn real = hux_libc_sigaction();
    struct sigaction cur;

    pthread_mutex_lock(&hux_sigint_mu);
    if ((--hux_sigint_users == 0) && (real(SIGINT, NULL, &cur) == 0) &&
        (hux_handler(&cur) == (void*)hux_sigint_handler)) {
        real(SIGINT, &hux_sigint_prev, NULL);
    }
    pthread_mutex_unlock(&hux_sigint_mu);
}

static int hux_sigint_since(unsigned seen)
{
    return __atomic_load_n(&hux_sigint_count, __ATOMIC_ACQUIRE) != seen;
}

/* ---- context and worker ------------------------------------------------ */

ucs_status_t hux_config_read(ucp_config_t **config)
{
    return ucp_config_read(NULL, NULL, config);
}

ucs_status_t hux_init(ucp_config_t *config, int size, int wakeup,
                      ucp_context_h *context)
{
    ucp_params_t params;

    memset(&params, 0, sizeof(params));
    params.field_mask        = UCP_PARAM_FIELD_FEATURES |
                               UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                               UCP_PARAM_FIELD_ESTIMATED_NUM_EPS |
                               UCP_PARAM_FIELD_NAME;
    params.features          = UCP_FEATURE_TAG | UCP_FEATURE_AM | /* goodbyes */
                               (wakeup ? UCP_FEATURE_WAKEUP : 0);
    params.mt_workers_shared = 0;
    params.estimated_num_eps = (size > 1) ? size - 1 : 1;
    params.name              = "halo";
    return ucp_init(&params, config, context);
}

/* The memory types the context's transports can send from and receive
 * into, as a bit set of ucs_memory_type_t. */
ucs_status_t hux_context_memory_types(ucp_context_h context, uint64_t *types)
{
    ucp_context_attr_t attr;
    ucs_status_t status;

    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    status          = ucp_context_query(context, &attr);
    if (status == UCS_OK) {
        *types = attr.memory_types;
    }
    return status;
}

static ucs_status_t hux_bye_listen(hux_transport_t *t);

ucs_status_t hux_worker_create(hux_transport_t *t, int wakeup)
{
    ucp_worker_params_t params;
    ucs_status_t status;

    /* One goroutine at a time, but not always on the same OS thread. */
    memset(&params, 0, sizeof(params));
    params.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    status = ucp_worker_create(t->context, &params, &t->worker);
    if (status == UCS_OK) {
        status = hux_bye_listen(t);
    }
    if ((status != UCS_OK) || !wakeup) {
        return status;
    }
    /* Without an event fd the wait loop yields instead of sleeping. */
    if (ucp_worker_get_efd(t->worker, &t->efd) != UCS_OK) {
        t->efd = -1;
    }
    return UCS_OK;
}

ucs_status_t hux_worker_address(ucp_worker_h worker, void **addr, size_t *len)
{
    ucp_address_t *a;
    ucs_status_t status;

    status = ucp_worker_get_address(worker, &a, len);
    if (status != UCS_OK) {
        return status;
    }
    *addr = malloc(*len);
    if (*addr == NULL) {
        ucp_worker_release_address(worker, a);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(*addr, a, *len);
    ucp_worker_release_address(worker, a);
    return UCS_OK;
}

/* ---- transport ---------------------------------------------------------- */

hux_transport_t *hux_transport_new(int rank, int size)
{
    hux_transport_t *t;
    int i;

    t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return NULL;
    }
    t->peers = calloc(size, sizeof(*t->peers));
    if (t->peers == NULL) {
        free(t);
        return NULL;
    }
    for (i = 0; i < size; ++i) {
        t->peers[i].rank  = i;
        t->peers[i].err   = UCS_OK;
        t->peers[i].cause = -1;
    }
    t->rank = rank;
    t->size = size;
    t->efd  = -1;
    t->abort_cause = -1;
    return t;
}

/*
 * Makes every wait on the transport, running or future, end at once with
 * HUX_WAIT_ABORTED. Safe from any thread: it only sets a flag and wakes a
 * wait that sleeps on the worker's event fd (ucp_worker_signal writes to
 * that fd and takes no lock). A spinning or yielding wait sees the flag
 * within HUX_CLOCK_EVERY polls.
 */
void hux_transport_abort(hux_transport_t *t)
{
    __atomic_store_n(&t->aborted, 1, __ATOMIC_RELEASE);
    if ((t->efd >= 0) && (t->worker != NULL)) {
        ucp_worker_signal(t->worker);
    }
}

int hux_transport_aborted(hux_transport_t *t)
{
    return __atomic_load_n(&t->aborted, __ATOMIC_ACQUIRE);
}

/*
 * Says that peer's process has ended (its liveness link outside UCX closed
 * without a goodbye: comm/liveness.go). Safe from any thread, like
 * hux_transport_abort: it sets flags and wakes a sleeping wait; the thread
 * that drives the worker acts on them (hux_take_gone).
 */
void hux_peer_gone(hux_transport_t *t, int peer)
{
    if ((peer < 0) || (peer >= t->size) || (peer == t->rank)) {
        return;
    }
    __atomic_store_n(&t->peers[peer].gone, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&t->gone, 1, __ATOMIC_RELEASE);
    if ((t->efd >= 0) && (t->worker != NULL)) {
        ucp_worker_signal(t->worker);
    }
}

ucs_status_t hux_ep_force_close(hux_transport_t *t, int peer, int64_t timeout_ns);

/*
 * On the thread that drives the worker: fails the peers hux_peer_gone named.
 * What they sent before they died is read first (a bounded drain: a goodbye,
 * or the last messages of an exchange that can still complete); then the
 * peer's status becomes HUX_ERR_PEER_GONE and its endpoint is force-closed,
 * which completes the sends still on it (UCX never fails a send to a dead
 * peer without peer error handling: ucx/NOTES.md); receives from it are
 * cancelled by hux_batch_reap. One load of a flag when nobody died.
 */
static void hux_take_gone(hux_transport_t *t)
{
    int i, n;

    if ((__atomic_load_n(&t->gone, __ATOMIC_ACQUIRE) == 0) ||
        (__atomic_exchange_n(&t->gone, 0, __ATOMIC_ACQ_REL) == 0) ||
        (t->worker == NULL)) {
        return;
    }
    for (n = 0; (n < 64) && (ucp_worker_progress(t->worker) != 0); ++n) {
    }
    for (i = 0; i < t->size; ++i) {
        hux_peer_t *p = &t->peers[i];
        if (__atomic_load_n(&p->gone, __ATOMIC_ACQUIRE) != 1) {
            continue;
        }
        p->gone = 2;
        if (p->err == UCS_OK) {
            p->err = HUX_ERR_PEER_GONE;
        }
        hux_ep_force_close(t, i, t->grace_ns);
        ++t->ngone;
    }
}

static void hux_zombie_add(hux_transport_t *t, void *p)
{
    void **z;
    int cap;

    if (t->nzombies == t->capzombies) {
        cap = (t->capzombies == 0) ? 16 : 2 * t->capzombies;
        z   = realloc(t->zombies, cap * sizeof(*z));
        if (z == NULL) {
            return; /* leak rather than free memory UCX may still use */
        }
        t->zombies    = z;
        t->capzombies = cap;
    }
    t->zombies[t->nzombies++] = p;
}

/* Expects every endpoint to be closed already (hux_ep_force_close). */
void hux_transport_destroy(hux_transport_t *t)
{
    int i;

    if (t->worker != NULL) {
        ucp_worker_destroy(t->worker);
    }
    if (t->context != NULL) {
        ucp_cleanup(t->context);
    }
    /* Only now can nothing read the batches UCX was still working on. */
    for (i = 0; i < t->nzombies; ++i) {
        free(t->zombies[i]);
    }
    free(t->zombies);
    free(t->peers);
    free(t);
}

/* ---- endpoints ----------------------------------------------------------- */

/* Runs inside ucp_worker_progress, on the thread that drives the transport. */
static void hux_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    hux_peer_t *p = arg;

    (void)ep;
    if (p->err == UCS_OK) {
        p->err = status;
    }
}

/*
 * While the calling thread creates an endpoint, UCX's error lines (a dead
 * peer's shared memory that can no longer be attached, on stderr) are
 * captured instead of printed: the caller turns the failure into an error
 * that names the rank, and keeps the first line as its detail.
 */
static __thread char  *hux_quiet_buf;
static __thread size_t hux_quiet_len;
static pthread_once_t  hux_quiet_once = PTHREAD_ONCE_INIT;

static ucs_log_func_rc_t
hux_quiet_log(const char *file, unsigned line, const char *function,
              ucs_log_level_t level,
              const ucs_log_component_config_t *comp_conf,
              const char *message, va_list ap)
{
    va_list aq;

    (void)file; (void)line; (void)function; (void)comp_conf;
    if ((hux_quiet_buf == NULL) || (level > UCS_LOG_LEVEL_ERROR)) {
        return UCS_LOG_FUNC_RC_CONTINUE;
    }
    if (hux_quiet_buf[0] == '\0') {
        va_copy(aq, ap);
        vsnprintf(hux_quiet_buf, hux_quiet_len, message, aq);
        va_end(aq);
    }
    return UCS_LOG_FUNC_RC_STOP;
}

static void hux_quiet_install(void)
{
    /* The last handler pushed runs first; it stays, idle on other threads. */
    ucs_log_push_handler(hux_quiet_log);
}

/* Runs inside ucp_worker_progress when a peer's goodbye arrives. */
static ucs_status_t hux_bye_received(void *arg, const void *header,
                                     size_t header_length, void *data,
                                     size_t length,
                                     const ucp_am_recv_param_t *param)
{
    hux_transport_t *t = arg;
    int32_t bye[3];
    hux_peer_t *p;

    (void)header; (void)header_length;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        (length != sizeof(bye))) {
        return UCS_OK; /* not ours: dropped */
    }
    memcpy(bye, data, sizeof(bye));
    if ((bye[0] < 0) || (bye[0] >= t->size) || (bye[0] == t->rank)) {
        return UCS_OK;
    }
    p = &t->peers[bye[0]];
    p->cause = bye[2];
    if (p->err == UCS_OK) {
        p->err = (bye[1] == HUX_BYE_ABORTED) ? HUX_ERR_PEER_ABORTED :
                                               HUX_ERR_PEER_CLOSED;
    }
    return UCS_OK;
}

/*
 * Goodbyes travel as UCX active messages of their own id, outside the tag
 * space, which is all the caller's (halo matches on parts of tags). On one
 * endpoint they follow the tag messages sent before them (same lane, in
 * order, for shared memory and TCP).
 */
static ucs_status_t hux_bye_listen(hux_transport_t *t)
{
    ucp_am_handler_param_t param;

    memset(&param, 0, sizeof(param));
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                       UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id         = HUX_AM_BYE;
    param.cb         = hux_bye_received;
    param.arg        = t;
    return ucp_worker_set_am_recv_handler(t->worker, &param);
}

/*
 * Tells every connected peer that this transport closes (HUX_BYE_ABORTED
 * once it was aborted), after every message sent to that peer before.
 * Progresses until the sends are out or timeout_ns passes; a peer that is
 * gone already is not waited for. Each peer is told once.
 */
void hux_say_goodbye(hux_transport_t *t, int64_t timeout_ns)
{
    int32_t what = hux_transport_aborted(t) ? HUX_BYE_ABORTED : HUX_BYE_CLOSED;
    ucp_request_param_t param;
    ucs_status_ptr_t *reqs;
    int i, pending = 0;
    int64_t end;

    reqs = calloc(t->size, sizeof(*reqs));
    if (reqs == NULL) {
        return;
    }
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags        = UCP_AM_SEND_FLAG_EAGER;
    for (i = 0; i < t->size; ++i) {
        hux_peer_t *p = &t->peers[i];
        if ((p->ep == NULL) || (p->err != UCS_OK) || p->bye_sent) {
            continue;
        }
        p->bye_sent = 1;
        p->bye[0]   = t->rank;
        p->bye[1]   = what;
        p->bye[2]   = t->abort_cause;
        reqs[i] = ucp_am_send_nbx(p->ep, HUX_AM_BYE, NULL, 0, p->bye,
                                  sizeof(p->bye), &param);
        if (UCS_PTR_IS_PTR(reqs[i])) {
            ++pending;
        } else {
            reqs[i] = NULL;
        }
    }
    end = hux_end_ns(timeout_ns);
    while (pending > 0) {
        ucp_worker_progress(t->worker);
        for (i = 0; i < t->size; ++i) {
            if ((reqs[i] != NULL) &&
                (ucp_request_check_status(reqs[i]) != UCS_INPROGRESS)) {
                ucp_request_free(reqs[i]);
                reqs[i] = NULL;
                --pending;
            }
        }
        if (hux_now_ns() >= end) {
            break;
        }
    }
    for (i = 0; i < t->size; ++i) {
        if (reqs[i] != NULL) {
            ucp_request_free(reqs[i]); /* the force close ends it */
        }
    }
    free(reqs);
}

/*
 * After a batch completed every operation: reads what waits on the wire (a
 * peer's goodbye queues behind the messages the batch completed on), a
 * bounded number of times, and notes a peer of the batch that said it
 * aborted: what the batch matched from it belongs to an exchange it
 * abandoned. In the wait itself, not a call of its own from Go: the check
 * then costs an idle progress, not a crossing (measured, bench/RESULTS.md).
 */
static void hux_batch_goodbyes(hux_batch_t *b)
{
    hux_transport_t *t = b->tr;
    int i;

    for (i = 0; (i < 16) && (ucp_worker_progress(t->worker) != 0); ++i) {
    }
    b->aborted_peer = -1;
    for (i = 0; i < b->nops; ++i) {
        if (t->peers[b->ops[i].peer].err == HUX_ERR_PEER_ABORTED) {
            b->aborted_peer = b->ops[i].peer;
            return;
        }
    }
}

ucs_status_t hux_ep_create(hux_transport_t *t, int peer, const void *addr,
                           int peer_err_mode, char *why, size_t why_len)
{
    ucp_ep_params_t params;
    ucs_status_t status;

    memset(&params, 0, sizeof(params));
    params.field_mask      = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                             UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                             UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address         = (const ucp_address_t*)addr;
    params.err_mode        = peer_err_mode ? UCP_ERR_HANDLING_MODE_PEER :
                                             UCP_ERR_HANDLING_MODE_NONE;
    /* Installed in both modes: without a callback UCX would only log a
     * transport error, with it the peer is marked failed. */
    params.err_handler.cb  = hux_ep_error;
    params.err_handler.arg = &t->peers[peer];
    pthread_once(&hux_quiet_once, hux_quiet_install);
    why[0]        = '\0';
    hux_quiet_buf = why;
    hux_quiet_len = why_len;
    status        = ucp_ep_create(t->worker, &params, &t->peers[peer].ep);
    hux_quiet_buf = NULL;
    return status;
}

/*
 * Closes an endpoint without asking the peer, which completes every request
 * still on it with UCS_ERR_CANCELED: the only way to make UCX let go of a
 * send buffer. Never waits for the peer, only (boundedly) for UCX; returns
 * UCS_ERR_TIMED_OUT if UCX had not finished closing by then (the worker's
 * destruction finishes it).
 */
ucs_status_t hux_ep_force_close(hux_transport_t *t, int peer, int64_t timeout_ns)
{
    hux_peer_t *p = &t->peers[peer];
    ucp_request_param_t param;
    ucs_status_ptr_t req;
    ucs_status_t status;
    int64_t end;

    if (p->ep == NULL) {
        return UCS_OK;
    }
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags        = UCP_EP_CLOSE_FLAG_FORCE;
    req                = ucp_ep_close_nbx(p->ep, &param);
    p->ep              = NULL;
    if (p->err == UCS_OK) {
        p->err = UCS_ERR_CANCELED;
    }
    if ((req == NULL) || UCS_PTR_IS_ERR(req)) {
        return UCS_OK; /* an error here is the failure we are closing for */
    }
    end = hux_end_ns(timeout_ns);
    while ((status = ucp_request_check_status(req)) == UCS_INPROGRESS) {
        ucp_worker_progress(t->worker);
        if (hux_now_ns() >= end) {
            return UCS_ERR_TIMED_OUT;
        }
    }
    ucp_request_free(req);
    return UCS_OK;
}

/* ---- batches -------------------------------------------------------------- */

hux_batch_t *hux_batch_new(hux_transport_t *t, int nops, int nsegs, int nbases)
{
    hux_batch_t *b;

    b = calloc(1, sizeof(*b));
    if (b == NULL) {
        return NULL;
    }
    b->tr      = t;
    b->nops    = nops;
    b->nbases  = nbases;
    b->ops     = calloc((nops > 0) ? nops : 1, sizeof(*b->ops));
    b->bases   = calloc((nbases > 0) ? nbases : 1, sizeof(*b->bases));
    b->seg_off = calloc((nsegs > 0) ? nsegs : 1, sizeof(*b->seg_off));
    b->seg_base = calloc((nsegs > 0) ? nsegs : 1, sizeof(*b->seg_base));
    b->iov     = calloc((nsegs > 0) ? nsegs : 1, sizeof(*b->iov));
    if ((b->ops == NULL) || (b->bases == NULL) || (b->seg_off == NULL) ||
        (b->seg_base == NULL) || (b->iov == NULL)) {
        free(b->ops);
        free(b->bases);
        free(b->seg_off);
        free(b->seg_base);
        free(b->iov);
        free(b);
        return NULL;
    }
    return b;
}

static void hux_op_finish(hux_batch_t *b, hux_op_t *op, ucs_status_t status)
{
    if (!op->is_send &&
        ((status == UCS_OK) || (status == UCS_ERR_MESSAGE_TRUNCATED))) {
        /* For a truncated message this is the sender's length. */
        op->received = op->info.length;
        if ((status == UCS_ERR_MESSAGE_TRUNCATED) &&
            (op->mask != (ucp_tag_t)-1)) {
            /* A loose receive takes any length: its caller compares
             * info.sender_tag and received with what it expected. */
            status = UCS_OK;
        }
    }
    /* Ended by its peer's failure (a force close after hux_take_gone or
     * another batch's deadline completes it as cancelled): say so. */
    if ((status != UCS_OK) && (op->why == HUX_WHY_NONE) &&
        (b->tr->peers[op->peer].err != UCS_OK)) {
        op->why = HUX_WHY_PEER;
    }
    op->status = status;
    ucp_request_free(op->req);
    op->req = NULL;
    --b->pending;
}

/*
 * Posts every operation: receives first (so that no message of this batch
 * arrives unexpected because of our own ordering), then sends. An operation
 * that cannot start gets its status now and is reported by Wait. Returns -1,
 * posting nothing, once the transport is aborted (checked here rather than
 * in a cgo call of its own: one crossing per post).
 */
int hux_batch_post(hux_batch_t *b)
{
    const uintptr_t *bases = b->bases;
    hux_transport_t *t     = b->tr;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    hux_peer_t *p;
    hux_op_t *op;
    void *buf;
    size_t count;
    int i, s;

    if (hux_transport_aborted(t)) {
        return -1;
    }
    b->pending      = 0;
    b->first        = 0;
    b->aborted_peer = -1;
    for (i = 0; i < b->nops; ++i) {
        op            = &b->ops[i];
        op->req       = NULL;
        op->status    = UCS_INPROGRESS;
        op->why       = HUX_WHY_NONE;
        op->cancelled = 0;
        op->received  = 0;
        p             = &t->peers[op->peer];

        /* A device's memory says so; host requests stay as they were
         * measured (an A/B at 2 KiB and 2 MiB on a loaded 2-CPU machine
         * could not tell the two apart, see NOTES.md). */
        param.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
        if (op->memory_type != UCS_MEMORY_TYPE_HOST) {
            param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memory_type   = (ucs_memory_type_t)op->memory_type;
        }
        if (op->nseg > 1) {
            for (s = 0; s < op->nseg; ++s) {
                op->iov[s].buffer = (void*)(bases[op->seg_base[s]] +
                                            op->seg_off[s]);
            }
            buf            = op->iov;
            count          = op->nseg;
            param.datatype = ucp_dt_make_iov();
        } else {
            buf            = (void*)(bases[op->base] + op->off);
            count          = op->bytes;
            param.datatype = ucp_dt_make_contig(1);
        }

        /* A receive from a failed peer would wait forever: tag matching
         * does not know about endpoints. */
        if ((p->err != UCS_OK) || (p->ep == NULL)) {
            op->status = (p->err != UCS_OK) ? p->err : UCS_ERR_NOT_CONNECTED;
            op->why    = HUX_WHY_PEER;
            continue;
        }

        if (op->is_send) {
            sp = ucp_tag_send_nbx(p->ep, buf, count, op->tag | b->tag_or,
                                  &param);
        } else {
            /* UCX 1.13 documents recv_info for an immediate completion but
             * never fills it in: without a request the received length
             * would be unknown, and a short message would go unnoticed. */
            param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
            sp = ucp_tag_recv_nbx(t->worker, buf, count, op->tag | b->tag_or,
                                  op->mask, &param);
        }

        if (sp == NULL) {
            op->status = UCS_OK; /* a send (receives always get a request) */
        } else if (UCS_PTR_IS_ERR(sp)) {
            op->status = UCS_PTR_STATUS(sp);
        } else {
            op->req = sp;
            ++b->pending;
        }
    }
    return 0;
}

/* Collects completed requests; cancels receives whose peer has failed. */
static void hux_batch_reap(hux_batch_t *b)
{
    hux_transport_t *t = b->tr;
    ucs_status_t status;
    hux_op_t *op;
    int i, first = -1;

    for (i = b->first; i < b->nops; ++i) {
        op = &b->ops[i];
        if (op->req == NULL) {
            continue;
        }
        if (op->is_send) {
            status = ucp_request_check_status(op->req);
        } else {
            status = ucp_tag_recv_request_test(op->req, &op->info);
        }
        if (status != UCS_INPROGRESS) {
            hux_op_finish(b, op, status);
            continue;
        }
        if (first < 0) {
            first = i;
        }
        if (!op->is_send && !op->cancelled &&
            (t->peers[op->peer].err != UCS_OK)) {
            op->why       = HUX_WHY_PEER;
            op->cancelled = 1;
            ucp_request_cancel(t->worker, op->req);
        }
    }
    b->first = (first < 0) ? b->nops : first;
}

/*
 * Ends the batch's sends to peers that hux_take_gone failed which the force
 * close did not complete: a rendezvous send to a dead peer waits for an
 * answer that never comes (ucx/NOTES.md). As after a deadline, the batch is
 * then a zombie (UCX may hold the request until the worker goes), and the
 * request is left to UCX; a send only reads the caller's memory, and only
 * the dead peer would have read it. Nothing to do, and one load, while no
 * peer has died.
 */
static void hux_batch_drop_gone(hux_batch_t *b)
{
    hux_transport_t *t = b->tr;
    hux_op_t *op;
    int i;

    if (t->ngone == 0) {
        return;
    }
    for (i = b->first; i < b->nops; ++i) {
        op = &b->ops[i];
        if ((op->req != NULL) && op->is_send && (t->peers[op->peer].gone == 2)) {
            op->status = t->peers[op->peer].err;
            op->why    = HUX_WHY_PEER;
            op->req    = NULL;
            --b->pending;
            b->zombie  = 1;
        }
    }
}

/* Progresses until reap leaves nothing pending, or end passes. */
static int hux_batch_drain(hux_batch_t *b, int64_t end)
{
    ucp_worker_h worker = b->tr->worker;

    hux_batch_reap(b);
    while (b->pending > 0) {
        ucp_worker_progress(worker);
        hux_batch_reap(b);
        if (hux_now_ns() >= end) {
            break;
        }
    }
    return b->pending;
}

/*
 * Ends every outstanding operation: receives are cancelled; whatever is still
 * outstanding after a grace period (sends, which UCX cannot cancel, and
 * receives already matched to a message in flight) is completed by
 * force-closing its peer's endpoint. When this returns, UCX holds no
 * reference to the batch's buffers, except for requests it failed to finish
 * even then: those and the batch's I/O vectors are kept until the worker is
 * destroyed.
 */
void hux_batch_abort(hux_batch_t *b, int why)
{
    hux_transport_t *t = b->tr;
    hux_op_t *op;
    int i;

    hux_batch_reap(b);
    for (i = b->first; i < b->nops; ++i) {
        op = &b->ops[i];
        if (op->req == NULL) {
            continue;
        }
        if (op->why == HUX_WHY_NONE) {
            op->why = why;
        }
        if (!op->is_send && !op->cancelled) {
            op->cancelled = 1;
            ucp_request_cancel(t->worker, op->req);
        }
    }
    if (hux_batch_drain(b, hux_end_ns(t->grace_ns)) == 0) {
        return;
    }

    for (i = b->first; i < b->nops; ++i) {
        op = &b->ops[i];
        if (op->req != NULL) {
            hux_ep_force_close(t, op->peer, t->grace_ns);
        }
    }
    if (hux_batch_drain(b, hux_end_ns(t->grace_ns)) == 0) {
        return;
    }

    /* UCX did not let go: let the worker's destruction end these. */
    for (i = b->first; i < b->nops; ++i) {
        op = &b->ops[i];
        if (op->req != NULL) {
            op->status = UCS_ERR_CANCELED;
            op->req    = NULL;
            --b->pending;
        }
    }
    b->zombie = 1;
}

/*
 * Sleeps on the worker's event fd until UCX has something to progress, the
 * end passes, or the transport is aborted (which signals the worker). Arming
 * fails with UCS_ERR_BUSY when events are already pending: then there is
 * nothing to sleep for.
 */
static void hux_worker_sleep(hux_transport_t *t, int64_t end, int armed)
{
    struct pollfd pfd = {.fd = t->efd, .events = POLLIN};
    struct timespec ts;
    int64_t left;

    if (ucp_worker_arm(t->worker) != UCS_OK) {
        return;
    }
    if (hux_transport_aborted(t) || __atomic_load_n(&t->gone, __ATOMIC_ACQUIRE)) {
        return; /* the signal may have come before the arm */
    }
    left = end - hux_now_ns();
    if (armed && (left > HUX_SIGINT_SLICE_NS)) {
        left = HUX_SIGINT_SLICE_NS;
    }
    if (left <= 0) {
        return;
    }
    ts.tv_sec  = left / 1000000000;
    ts.tv_nsec = left % 1000000000;
    /* An EINTR (Go's preemption signal) just ends this sleep early. */
    (void)ppoll(&pfd, 1, &ts, NULL);
}

/* Ends a wait that must not go on: the deadline passed or an abort came. */
static int hux_batch_stop(hux_batch_t *b)
{
    if (hux_transport_aborted(b->tr)) {
        hux_batch_abort(b, HUX_WHY_ABORT);
        return HUX_WAIT_ABORTED;
    }
    hux_batch_abort(b, HUX_WHY_DEADLINE);
    return HUX_WAIT_DEADLINE;
}

/*
 * The Wait loop: progress, spinning up to t->spin idle polls, then yielding
 * the CPU between polls, and once the wait has been idle for t->sleep_ns,
 * sleeping on the worker's event fd until UCX has an event; until every
 * operation has finished, the deadline has passed or the transport is
 * aborted (then the batch is aborted). Yielding first keeps short waits
 * fast when ranks outnumber CPUs (a sleeping rank wakes later than a
 * yielding one is rescheduled: bench/RESULTS.md); sleeping ends long waits'
 * use of a CPU that the rank's peers or its own threads need. Requests are
 * examined after a poll that made progress; requests, clock and abort flag
 * every HUX_CLOCK_EVERY polls while spinning and after every yield or sleep.
 * The timeout starts at the first clock reading, a few microseconds into the
 * wait: a wait that ends sooner (a small halo) reads no clock at all, which
 * here costs 43 ns a reading (kvm-clock). A wait that has lasted
 * HUX_SIGINT_AFTER_NS since that reading (it wakes from a sleep for it)
 * watches SIGINT (*armed, *seen: see hux_sigint_arm); a SIGINT then aborts
 * the transport and ends the wait. Peers that hux_peer_gone named are acted
 * on at every look at the clock.
 */
static int hux_batch_wait_ops(hux_batch_t *b, int64_t timeout_ns, int *armed,
                              unsigned *seen)
{
    hux_transport_t *t  = b->tr;
    ucp_worker_h worker = t->worker;
    unsigned polls      = 0;
    int idle            = 0;
    int64_t idle_since  = 0; /* when the spin ran out, while idle */
    int64_t end         = -1; /* set at the first clock reading */
    int64_t arm_at      = -1; /* likewise: when to watch SIGINT */
    int check;
    int64_t now;

    hux_batch_reap(b);
    if (b->pending == 0) {
        return HUX_WAIT_DONE;
    }
    hux_take_gone(t);
    for (;;) {
        if (ucp_worker_progress(worker) != 0) {
            idle       = 0;
            idle_since = 0;
            hux_batch_reap(b);
            if (b->pending == 0) {
                return HUX_WAIT_DONE;
            }
        }
        check = (++polls % HUX_CLOCK_EVERY) == 0;
        if ((t->spin >= 0) && (++idle > t->spin)) {
            hux_batch_reap(b);
            if (b->pending == 0) {
                return HUX_WAIT_DONE;
            }
            now = hux_now_ns();
            if (end < 0) {
                end    = hux_end_at(now, timeout_ns);
                arm_at = now + HUX_SIGINT_AFTER_NS;
            }
            if (idle_since == 0) {
                idle_since = now;
            }
            if ((t->efd >= 0) && (t->sleep_ns >= 0) &&
                (now - idle_since >= t->sleep_ns)) {
                /* Wake to arm the SIGINT watch before a long sleep. */
                hux_worker_sleep(t, ((arm_at >= 0) && (arm_at < end)) ? arm_at : end,
                                 *armed);
            } else {
                sched_yield();
            }
            check = 1;
        }
        if (check) {
            hux_take_gone(t);
            hux_batch_reap(b);
            hux_batch_drop_gone(b);
            if (b->pending == 0) {
                return HUX_WAIT_DONE;
            }
            if (*armed && hux_sigint_since(*seen)) {
                hux_transport_abort(t);
                hux_batch_abort(b, HUX_WHY_SIGINT);
                return HUX_WAIT_SIGINT;
            }
            now = hux_now_ns();
            if (end < 0) {
                end    = hux_end_at(now, timeout_ns);
                arm_at = now + HUX_SIGINT_AFTER_NS;
            }
            if ((arm_at >= 0) && (now >= arm_at)) {
                arm_at = -1;
                *armed = hux_sigint_arm(seen);
            }
            if ((now >= end) || hux_transport_aborted(t)) {
                return hux_batch_stop(b);
            }
        }
    }
}

/*
 * One look without blocking: progresses the worker while it has events, then
 * reports whether every operation has finished (1) or not (0). An abort ends
 * the batch as hux_batch_wait would (then 1, with the operations' statuses).
 */
int hux_batch_wait(hux_batch_t *b, int64_t timeout_ns)
{
    unsigned seen = 0;
    int armed = 0;
    int r = hux_batch_wait_ops(b, timeout_ns, &armed, &seen);

    if (armed) {
        hux_sigint_disarm();
    }
    if (r == HUX_WAIT_DONE) {
        hux_batch_goodbyes(b);
    }
    return r;
}

int hux_batch_test(hux_batch_t *b)
{
    hux_transport_t *t = b->tr;
    int n = 0;

    hux_take_gone(t);
    while ((ucp_worker_progress(t->worker) != 0) && (++n < 64)) {
    }
    hux_batch_reap(b);
    hux_batch_drop_gone(b);
    if (b->pending == 0) {
        hux_batch_goodbyes(b);
        return 1;
    }
    if (hux_transport_aborted(t)) {
        hux_batch_abort(b, HUX_WHY_ABORT);
        return 1;
    }
    return 0;
}

void hux_batch_destroy(hux_batch_t *b)
{
    if (b->pending > 0) {
        hux_batch_abort(b, HUX_WHY_DEADLINE);
    }
    free(b->ops);
    free(b->bases);
    if (b->zombie) {
        /* UCX may still read the I/O vectors of a request it kept. */
        hux_zombie_add(b->tr, b->iov);
    } else {
        free(b->iov);
    }
    free(b->seg_off);
    free(b->seg_base);
    free(b);
}

/* ---- memory ------------------------------------------------------------------ */

/* Page-aligned and zeroed, so that large messages start on a page boundary. */
void *hux_alloc(size_t n)
{
    void *p = NULL;

    if (posix_memalign(&p, 4096, (n > 0) ? n : 1) != 0) {
        return NULL;
    }
    memset(p, 0, n);
    return p;
}
