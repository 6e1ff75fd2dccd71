/*
 * C side of package ucx: the state UCX may touch (peers, operations, I/O
 * vectors) lives in C memory declared here, and the loops that would
 * otherwise cross from Go to C once per poll (post a batch, progress until it
 * is done, abort it) are single C calls. Nothing here holds a Go pointer.
 */
#ifndef HALO_UCX_HELPERS_H
#define HALO_UCX_HELPERS_H

#include <stddef.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

/* Why an operation ended without success (hux_op_t.why). */
enum {
    HUX_WHY_NONE     = 0, /* see hux_op_t.status */
    HUX_WHY_PEER     = 1, /* its peer's endpoint failed or was closed */
    HUX_WHY_DEADLINE = 2, /* still pending when the deadline passed */
    HUX_WHY_ABORT    = 3, /* the transport was aborted (hux_transport_abort) */
    HUX_WHY_SIGINT   = 4  /* a SIGINT came while the wait slept (the transport
                             was aborted for it) */
};

/* Return values of hux_batch_wait. */
enum {
    HUX_WAIT_DONE     = 0, /* every operation finished (each has a status) */
    HUX_WAIT_DEADLINE = 1, /* the deadline passed; the batch was aborted */
    HUX_WAIT_ABORTED  = 2, /* hux_transport_abort was called; likewise */
    HUX_WAIT_SIGINT   = 3  /* SIGINT during a long wait; transport aborted */
};

typedef struct hux_peer {
    ucp_ep_h     ep;     /* NULL before Connect and after a force close */
    ucs_status_t err;    /* UCS_OK while healthy; first failure otherwise */
    int          rank;
    int          bye_sent; /* this side's goodbye has gone to the peer */
    int32_t      bye[3];   /* and what it said (rank, HUX_BYE_*, the rank
                              whose death made it abort or -1): UCX may
                              read it until the worker is destroyed */
    int32_t      cause;    /* that third word of this peer's goodbye, or -1 */
    int          gone;     /* 1: hux_peer_gone said its process ended (any
                              thread); 2: the owning thread has acted on it */
} hux_peer_t;

/* A peer's goodbye: an active message (id HUX_AM_BYE) sent by a transport
 * that closes, to every peer it is connected to, after everything it sent
 * before. Its receipt sets the peer's err to one of the statuses below (in
 * UCX's endpoint-failure range, which UCX leaves unused there), so that
 * later posts to it fail at once and receives from it are cancelled. */
#define HUX_AM_BYE              1 /* small: UCX keeps a table up to the largest id */
#define HUX_BYE_CLOSED          1
#define HUX_BYE_ABORTED         2
#define HUX_ERR_PEER_CLOSED     ((ucs_status_t)-61)
#define HUX_ERR_PEER_ABORTED    ((ucs_status_t)-62)
/* The peer's process ended without a goodbye (its liveness link, outside
 * UCX, closed: hux_peer_gone). */
#define HUX_ERR_PEER_GONE       ((ucs_status_t)-63)

typedef struct hux_transport {
    ucp_context_h context;
    ucp_worker_h  worker;
    hux_peer_t   *peers;       /* size entries, index = rank */
    int           size;
    int           rank;
    int           spin;        /* idle polls before sleeping; < 0: never */
    int           efd;         /* the worker's event fd, or -1: yield instead */
    int64_t       sleep_ns;    /* idle time after the spin before a wait sleeps
                                  on efd (yielding until then); < 0: never */
    int           aborted;     /* set once by hux_transport_abort, any thread */
    int           gone;        /* set by hux_peer_gone (any thread), cleared
                                  by the thread that acts on it */
    int32_t       abort_cause; /* the dead rank an abort was for, or -1 */
    int           ngone;       /* peers acted on (hux_take_gone): their
                                  stuck sends are dropped (hux_batch_drop_gone) */
    int64_t       grace_ns;    /* how long an abort waits for cancellations */
    /* Requests UCX could not finish within an abort's grace period, and the
     * batch memory they may still read; both are released by
     * hux_transport_destroy after the worker (and so the requests) are gone. */
    void        **zombies;
    int           nzombies, capzombies;
} hux_transport_t;

typedef struct hux_op {
    /* Set once by Prepare. */
    ucp_tag_t     tag;       /* wire tag (sender rank in the top bits) */
    ucp_tag_t     mask;      /* receive only: the tag bits it matches (all,
                                or the sender and the caller's Match: then
                                any length is accepted, see Op.Match) */
    int32_t       peer;
    int32_t       is_send;
    int32_t       base;      /* base (index into hux_batch_t.bases) of the only segment when nseg <= 1 */
    int32_t       nseg;
    int64_t       off;       /* offset of the only segment when nseg <= 1 */
    int32_t      *seg_base;  /* nseg bases when nseg > 1 */
    size_t        bytes;     /* sum of the segment lengths */
    int64_t      *seg_off;   /* nseg offsets when nseg > 1 */
    ucp_dt_iov_t *iov;       /* nseg entries when nseg > 1 */
    int32_t       memory_type; /* ucs_memory_type_t of every segment */
    /* Per post. */
    void         *req;       /* outstanding UCX request, or NULL */
    ucs_status_t  status;    /* UCS_INPROGRESS while pending */
    int32_t       why;       /* HUX_WHY_* */
    int32_t       cancelled; /* ucp_request_cancel was called */
    size_t        received;  /* receive only: length UCX delivered */
    ucp_tag_recv_info_t info;
} hux_op_t;

typedef struct hux_batch {
    hux_transport_t *tr;
    hux_op_t        *ops;     /* receives first, then sends */
    int              nops;
    int              pending; /* operations with an outstanding request */
    int              first;   /* no request below this index is outstanding */
    int              zombie;  /* UCX kept requests that may read iov */
    uintptr_t       *bases;   /* nbases entries, written by Go before a post */
    ucp_tag_t        tag_or;  /* OR'ed into every tag of a post, written by Go */
    int32_t          aborted_peer; /* after a wait or test that completed every
                                      operation: a peer of the batch whose
                                      goodbye said it aborted, or -1 */
    int              nbases;
    int64_t         *seg_off; /* pool for the ops' seg_off arrays */
    int32_t         *seg_base; /* pool for the ops' seg_base arrays */
    ucp_dt_iov_t    *iov;     /* pool for the ops' iov arrays */
} hux_batch_t;

/* Signals */
int hux_reclaim_signals(void);

/* Context and worker */
ucs_status_t hux_config_read(ucp_config_t **config);
ucs_status_t hux_init(ucp_config_t *config, int size, int wakeup,
                      ucp_context_h *context);
ucs_status_t hux_worker_create(hux_transport_t *t, int wakeup);
ucs_status_t hux_worker_address(ucp_worker_h worker, void **addr, size_t *len);

/* Transport */
hux_transport_t *hux_transport_new(int rank, int size);
void hux_transport_destroy(hux_transport_t *t);
void hux_transport_abort(hux_transport_t *t);
int hux_transport_aborted(hux_transport_t *t);
void hux_peer_gone(hux_transport_t *t, int peer);

/* Endpoints */
ucs_status_t hux_ep_create(hux_transport_t *t, int peer, const void *addr,
                           int peer_err_mode, char *why, size_t why_len);
void hux_say_goodbye(hux_transport_t *t, int64_t timeout_ns);
ucs_status_t hux_ep_force_close(hux_transport_t *t, int peer, int64_t timeout_ns);

/* Batches */
hux_batch_t *hux_batch_new(hux_transport_t *t, int nops, int nsegs, int nbases);
int hux_batch_post(hux_batch_t *b);
ucs_status_t hux_context_memory_types(ucp_context_h context, uint64_t *types);
int hux_batch_wait(hux_batch_t *b, int64_t timeout_ns);
int hux_batch_test(hux_batch_t *b);
void hux_batch_abort(hux_batch_t *b, int why);
void hux_batch_destroy(hux_batch_t *b);

/* Memory */
void *hux_alloc(size_t n);

#endif /* HALO_UCX_HELPERS_H */
