// The public C names of libhalo: thin wrappers over the Go exports, so that
// include/halo.h never depends on cgo's generated header, and so that the
// last-error text lives in this thread's C buffer with no ownership puzzles.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "halo.h"
#include "calls.h"
#include "_cgo_export.h"

// The per-thread message buffer is allocated on first use: a __thread array
// would take static TLS, of which a library loaded at run time (ctypes,
// dlopen) gets only a few hundred bytes.
#define HALO_ERRLEN 2048
static pthread_key_t error_key;
static pthread_once_t error_once = PTHREAD_ONCE_INIT;
static void make_error_key(void) { pthread_key_create(&error_key, free); }

static char *error_buffer(void) {
    pthread_once(&error_once, make_error_key);
    char *b = pthread_getspecific(error_key);
    if (b == NULL && (b = calloc(1, HALO_ERRLEN)) != NULL && pthread_setspecific(error_key, b) != 0) {
        free(b);
        b = NULL;
    }
    return b;
}

/* A process forked from one that loaded libhalo has one thread and a copy of
 * a Go runtime whose other threads did not come along: a call into Go there
 * can wait for ever on a lock that one of them held at the fork (the
 * c_request_fork test hung so on a loaded machine). Its communicators,
 * plans and requests are the parent's. So in such a child no call enters
 * Go: destroy and free only forget (success), and every other call is
 * refused at once, saying why. libc's fork runs the handler; Go's own
 * fork+exec does not, and needs none. */
static volatile int forked_child;
static pid_t loader_pid;
static void mark_forked_child(void) { forked_child = 1; }
__attribute__((constructor)) static void watch_forks(void) {
    loader_pid = getpid();
    pthread_atfork(NULL, NULL, mark_forked_child);
}

static halo_result_t refuse_in_child(const char *call) {
    char *b = error_buffer();
    if (b != NULL) {
        snprintf(b, HALO_ERRLEN,
                 "%s: this process (pid %ld) was forked from process %ld, which had loaded libhalo; Go's runtime "
                 "does not survive a fork, so here only destroy and free work (they forget the parent's objects). "
                 "Use libhalo in a process started by exec (Python: multiprocessing's spawn)",
                 call, (long)getpid(), (long)loader_pid);
    }
    return HALO_ERR_INVALID_STATE;
}

/* Every call that enters Go starts with one of these. */
#define IN_CHILD_REFUSE()                                                                                   \
    if (forked_child) return refuse_in_child(__func__)
#define IN_CHILD_FORGET()                                                                                   \
    if (forked_child) return HALO_SUCCESS

int halo_version_number(void) { return HALO_VERSION_NUMBER; }
const char *halo_version_string(void) { return HALO_VERSION_STRING; }
const char *halo_last_error(void) {
    const char *b = error_buffer();
    return b ? b : "";
}

const char *halo_strerror(halo_result_t result) {
    switch (result) {
    case HALO_SUCCESS: return "success";
    case HALO_ERR_INVALID_ARGUMENT: return "invalid argument";
    case HALO_ERR_INVALID_HANDLE: return "invalid handle";
    case HALO_ERR_MISMATCH: return "ranks disagree";
    case HALO_ERR_TIMEOUT: return "timed out";
    case HALO_ERR_PEER_FAILED: return "peer failed";
    case HALO_ERR_COMM_FAILED: return "communicator failed earlier";
    case HALO_ERR_RENDEZVOUS: return "rendezvous failed";
    case HALO_ERR_TRANSPORT: return "transport error";
    case HALO_ERR_INVALID_STATE: return "invalid state";
    case HALO_ERR_INTERNAL: return "internal error";
    }
    return "unknown result code";
}

halo_result_t halo_setting_get(const char *name, char *value, size_t len, int64_t *number) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoSettingGet((char *)name, value, len, number, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_create(int rank, int world_size, const halo_comm_params_t *params, halo_comm_t *comm) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoCommCreate(rank, world_size, (halo_comm_params_t *)params, comm, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_get_address(halo_comm_t comm, const void **address, size_t *length) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoCommGetAddress((uintptr_t)comm, (void **)address, length, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_connect(halo_comm_t comm, const void *const *addresses, const size_t *lengths) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoCommConnect((uintptr_t)comm, (void **)addresses, (size_t *)lengths, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_get_rank(halo_comm_t comm, int *rank, int *world_size) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoCommGetRank((uintptr_t)comm, rank, world_size, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_memory_types(halo_comm_t comm, uint64_t *types) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoCommMemoryTypes((uintptr_t)comm, types, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_destroy(halo_comm_t comm) {
    IN_CHILD_FORGET();
    return (halo_result_t)haloGoCommDestroy((uintptr_t)comm, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_create(halo_comm_t comm, const halo_plan_params_t *params, halo_plan_t *plan) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanCreate((uintptr_t)comm, (halo_plan_params_t *)params, plan, error_buffer(), HALO_ERRLEN);
}

/* The 0.3 blocking calls: halo_exchange with their tensors as its buffers. */
halo_result_t halo_plan_forward(halo_plan_t plan, const void *x, void *out) {
    void *b[2] = {(void *)x, out};
    return halo_exchange(plan, HALO_DIR_FORWARD, b, 2, NULL);
}

halo_result_t halo_plan_backward(halo_plan_t plan, const void *grad_out, void *grad_x) {
    void *b[2] = {(void *)grad_out, grad_x};
    return halo_exchange(plan, HALO_DIR_BACKWARD, b, 2, NULL);
}

halo_result_t halo_plan_halos_forward(halo_plan_t plan, const void *x, void *left, void *right) {
    void *b[3] = {(void *)x, left, right};
    return halo_exchange(plan, HALO_DIR_FORWARD, b, 3, NULL);
}

halo_result_t halo_plan_halos_backward(halo_plan_t plan, const void *grad_left, const void *grad_right, void *grad_x) {
    void *b[3] = {(void *)grad_left, (void *)grad_right, grad_x};
    return halo_exchange(plan, HALO_DIR_BACKWARD, b, 3, NULL);
}

/* The 0.3 start forms are not halo_exchange_start: their exchange is
 * finished by halo_plan_wait or halo_plan_test, which refuse one that a
 * request owns. */
halo_result_t halo_plan_forward_start(halo_plan_t plan, const void *x, void *out) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanStart((uintptr_t)plan, HALO_CALL_FORWARD, (void *)x, out, NULL, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_backward_start(halo_plan_t plan, const void *grad_out, void *grad_x) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanStart((uintptr_t)plan, HALO_CALL_BACKWARD, (void *)grad_out, grad_x, NULL, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_halos_forward_start(halo_plan_t plan, const void *x, void *left, void *right) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanStart((uintptr_t)plan, HALO_CALL_HALOS_FORWARD, (void *)x, left, right, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_halos_backward_start(halo_plan_t plan, const void *grad_left, const void *grad_right, void *grad_x) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanStart((uintptr_t)plan, HALO_CALL_HALOS_BACKWARD, (void *)grad_left, (void *)grad_right, grad_x, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_test(halo_plan_t plan, halo_direction_t direction, int *done) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanTest((uintptr_t)plan, (int)direction, done, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_wait(halo_plan_t plan, halo_direction_t direction) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanWait((uintptr_t)plan, (int)direction, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_comm_abort(halo_comm_t comm) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoCommAbort((uintptr_t)comm, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_plan_create_multi(halo_comm_t comm, int count, const halo_plan_params_t *params, halo_plan_t *plan) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoPlanCreateMulti((uintptr_t)comm, count, (halo_plan_params_t *)params, plan, error_buffer(), HALO_ERRLEN);
}

#define HALO_MULTI(name, call, start, A, B, C)                                                             \
    halo_result_t name(halo_plan_t plan, A, B, C) {                                                       \
        IN_CHILD_REFUSE();                                                                                 \
        return (halo_result_t)haloGoPlanMulti((uintptr_t)plan, call, start, (void **)a, (void **)b, (void **)c, \
                                              error_buffer(), HALO_ERRLEN);                                \
    }
#define HALO_MULTI2(name, call, start, A, B)                                                                     \
    halo_result_t name(halo_plan_t plan, A, B) {                                                                \
        IN_CHILD_REFUSE();                                                                                       \
        return (halo_result_t)haloGoPlanMulti((uintptr_t)plan, call, start, (void **)a, (void **)b, NULL, error_buffer(), \
                                              HALO_ERRLEN);                                                      \
    }
HALO_MULTI2(halo_plan_forward_multi, HALO_CALL_FORWARD, 0, const void *const *a, void *const *b)
HALO_MULTI2(halo_plan_backward_multi, HALO_CALL_BACKWARD, 0, const void *const *a, void *const *b)
HALO_MULTI(halo_plan_halos_forward_multi, HALO_CALL_HALOS_FORWARD, 0, const void *const *a, void *const *b, void *const *c)
HALO_MULTI(halo_plan_halos_backward_multi, HALO_CALL_HALOS_BACKWARD, 0, const void *const *a, const void *const *b, void *const *c)
HALO_MULTI2(halo_plan_forward_multi_start, HALO_CALL_FORWARD, 1, const void *const *a, void *const *b)
HALO_MULTI2(halo_plan_backward_multi_start, HALO_CALL_BACKWARD, 1, const void *const *a, void *const *b)
HALO_MULTI(halo_plan_halos_forward_multi_start, HALO_CALL_HALOS_FORWARD, 1, const void *const *a, void *const *b, void *const *c)
HALO_MULTI(halo_plan_halos_backward_multi_start, HALO_CALL_HALOS_BACKWARD, 1, const void *const *a, const void *const *b, void *const *c)

halo_result_t halo_plan_destroy(halo_plan_t plan) {
    IN_CHILD_FORGET();
    return (halo_result_t)haloGoPlanDestroy((uintptr_t)plan, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_exchange(halo_plan_t plan, halo_direction_t direction, void *const *buffers, size_t count, void *stream) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoExchange((uintptr_t)plan, (int)direction, (void **)buffers, count, (uintptr_t)stream, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_exchange_start(halo_plan_t plan, halo_direction_t direction, void *const *buffers, size_t count,
                                  void *stream, halo_request_t *request) {
    IN_CHILD_REFUSE();
    /* A stream is a handle, not memory (CU_STREAM_LEGACY is 0x1): it crosses
     * as a number, never in a type Go's garbage collector takes for a pointer. */
    return (halo_result_t)haloGoExchangeStart((uintptr_t)plan, (int)direction, (void **)buffers, count, (uintptr_t)stream, request,
                                              error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_request_test(halo_request_t request, int *done) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoRequestTest((uintptr_t)request, done, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_request_wait(halo_request_t request, void *stream) {
    IN_CHILD_REFUSE();
    return (halo_result_t)haloGoRequestWait((uintptr_t)request, (uintptr_t)stream, error_buffer(), HALO_ERRLEN);
}

halo_result_t halo_request_free(halo_request_t request) {
    IN_CHILD_FORGET();
    return (halo_result_t)haloGoRequestFree((uintptr_t)request, error_buffer(), HALO_ERRLEN);
}
