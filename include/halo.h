/*
 * halo — halo exchange for context-parallel training, over UCX.
 *
 * A communicator connects the ranks of one context-parallel group; a plan is
 * made once per tensor layout (collectively, like an FFT plan) and run every
 * step through one call pair, halo_exchange (blocking) and
 * halo_exchange_start (which returns a request): the forward direction fills
 * the halos of a padded output with the neighbours' boundary slices, the
 * backward direction sends the halo gradients back and adds them into the
 * owners' input gradient.
 *
 * Thread safety: a communicator and its plans may be used by one thread at a
 * time; different communicators are independent. The one exception is
 * halo_comm_abort, which any thread may call at any time. halo_last_error is
 * per thread. Every function validates its arguments and returns a result code;
 * none aborts the caller. Output parameters (handles, addresses, sizes) are
 * written only on success. Tensors are another matter: exchanges receive
 * straight into the caller's tensors (no staging copy), so after a failed
 * exchange the contents of its output tensors (out, grad_x, left, right) are
 * unspecified; the communicator then refuses further work with
 * HALO_ERR_COMM_FAILED and can only be destroyed.
 *
 * Dead peers: a rank whose process ends without destroying its communicator
 * (killed, even by SIGKILL, or crashed) fails its peers' exchanges with it
 * with HALO_ERR_PEER_FAILED naming it within about 0.1 s, with every setting
 * at its default: each pair of ranks holds a TCP connection that carries
 * nothing, and the kernel closes a dead process's sockets. A forked child
 * holds its parent's copy open until it exits.
 *
 * SIGINT: a blocking call that has waited 10 ms in a process that handles
 * SIGINT itself (Python does; SIG_DFL and SIG_IGN are left alone) returns
 * HALO_ERR_COMM_FAILED when SIGINT arrives, after calling the process's
 * handler: its communicator is aborted (peers told, as by halo_comm_abort).
 */
#ifndef HALO_H
#define HALO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** @brief Version of this header. Compare with halo_version_number(). */
#define HALO_VERSION_MAJOR 0
#define HALO_VERSION_MINOR 4
#define HALO_VERSION_PATCH 0
#define HALO_VERSION_NUMBER (HALO_VERSION_MAJOR * 10000 + HALO_VERSION_MINOR * 100 + HALO_VERSION_PATCH)
#define HALO_VERSION_STRING "0.4.0"

/** @brief Result codes. Values are fixed forever; new ones are appended. */
typedef enum halo_result {
    HALO_SUCCESS              = 0,
    HALO_ERR_INVALID_ARGUMENT = 1,  /**< a NULL pointer, a bad size, shape, dim, dtype, ... */
    HALO_ERR_INVALID_HANDLE   = 2,  /**< NULL, destroyed or foreign communicator or plan */
    HALO_ERR_MISMATCH         = 3,  /**< ranks disagree on a plan (every rank gets this) */
    HALO_ERR_TIMEOUT          = 4,  /**< a deadline passed; the message names the peers */
    HALO_ERR_PEER_FAILED      = 5,  /**< a peer is gone */
    HALO_ERR_COMM_FAILED      = 6,  /**< the communicator failed earlier; destroy it */
    HALO_ERR_RENDEZVOUS       = 7,  /**< ranks could not find each other */
    HALO_ERR_TRANSPORT        = 8,  /**< UCX reported another error */
    HALO_ERR_INVALID_STATE    = 9,  /**< e.g. connect twice, plan before connect */
    HALO_ERR_INTERNAL         = 10  /**< a bug in halo; please report the message */
} halo_result_t;

/** @brief Element types. */
typedef enum halo_dtype {
    HALO_FLOAT32  = 0,
    HALO_FLOAT64  = 1,
    HALO_FLOAT16  = 2,
    HALO_BFLOAT16 = 3
} halo_dtype_t;

/**
 * @brief What fills halo slices outside the global sequence of T slices: the
 * padding modes of torch.nn.Conv3d. Rank r's padded output is F.pad of the
 * gathered sequence along dim, sliced to its shard and halos: a slot at
 * global position g < 0 or g >= T shows slice clamp(g, 0, T-1) (replicate),
 * -g or 2(T-1)-g (reflect: the edge slice is not repeated) or g mod T
 * (circular). The source may be on any rank, the caller's own included.
 * Reflect needs left, right < T, circular left, right <= T, replicate T > 0:
 * otherwise plan creation fails with HALO_ERR_INVALID_ARGUMENT naming the
 * mode, the halos and T. Ranks that disagree get HALO_ERR_MISMATCH.
 *
 * Backward (modes other than zeros): each slot's gradient is added to the
 * slice it was copied from, so that grad_x is bit-identical to torch 1.13's
 * CPU F.pad backward of the gathered padded gradient. That gradient sums the
 * ranks' grad_out at each position: the owner's own, then the ranks to its
 * right nearest first, then those to its left; a slot beyond an end, the
 * ranks nearest that end first. F.pad's backward then adds: replicate and
 * reflect, from +0, every position showing a slice in increasing position
 * (replicate's left slots summed first); circular, the slice's own, then the
 * right slot (+0 where a right halo exists but the slice is not its source),
 * then the left slot (likewise). float16 and bfloat16 add in float32 and
 * round after each addition, in that order.
 */
typedef enum halo_padding {
    HALO_PAD_ZEROS     = 0, /**< zeros, no gradient (the reference) */
    HALO_PAD_REPLICATE = 1, /**< the edge slice repeated */
    HALO_PAD_REFLECT   = 2, /**< mirrored about the edge slice */
    HALO_PAD_CIRCULAR  = 3  /**< wrapped around: rank 0's left halo ends the sequence */
} halo_padding_t;

/**
 * @brief Where a plan's tensors live. Bit (1 << type) of
 * halo_comm_memory_types says whether the transport moves that memory.
 */
typedef enum halo_memory_type {
    HALO_MEMORY_HOST = 0, /**< the CPU's memory (default) */
    HALO_MEMORY_CUDA = 1  /**< an NVIDIA GPU's memory: the library never touches it from the CPU */
} halo_memory_type_t;

/**
 * @brief The two exchanges of a plan. A padded plan's forward fills out from
 * x and its backward grad_x from grad_out; a halos-only plan's forward fills
 * left and right from x, its backward grad_x from grad_left and grad_right.
 */
typedef enum halo_direction {
    HALO_DIR_FORWARD  = 0,
    HALO_DIR_BACKWARD = 1
} halo_direction_t;

/** @brief How ranks find each other. */
typedef enum halo_bootstrap {
    HALO_BOOTSTRAP_RENDEZVOUS = 0, /**< TCP rendezvous hosted by rank 0 (default) */
    HALO_BOOTSTRAP_EXTERNAL   = 1  /**< caller exchanges addresses: halo_comm_get_address + halo_comm_connect */
} halo_bootstrap_t;

/**
 * @brief Marks the 0.3 plan calls, which halo_exchange and
 * halo_exchange_start replace. They stay, and keep working, within major
 * version 0; a caller that wants the compiler to find its uses of them
 * defines HALO_WARN_DEPRECATED before including this header (off by
 * default, so that builds with -Werror keep building).
 */
#if defined(HALO_WARN_DEPRECATED) && (defined(__GNUC__) || defined(__clang__))
#define HALO_DEPRECATED __attribute__((deprecated("use halo_exchange or halo_exchange_start")))
#else
#define HALO_DEPRECATED
#endif

typedef struct halo_comm *halo_comm_t; /**< opaque communicator handle */
typedef struct halo_plan *halo_plan_t; /**< opaque plan handle */
typedef struct halo_request *halo_request_t; /**< opaque handle of one started exchange */

/** @brief Bits of halo_comm_params_t.field_mask: which optional fields are set. */
enum {
    HALO_COMM_PARAM_BOOTSTRAP         = 1u << 0,
    HALO_COMM_PARAM_RENDEZVOUS        = 1u << 1,
    HALO_COMM_PARAM_TOKEN             = 1u << 2,
    HALO_COMM_PARAM_JOB_ID            = 1u << 3,
    HALO_COMM_PARAM_TIMEOUT           = 1u << 4,
    HALO_COMM_PARAM_BOOTSTRAP_TIMEOUT = 1u << 5
};

/**
 * @brief Optional communicator parameters. Unset fields come from the
 * environment (HALO_RENDEZVOUS, HALO_TOKEN, HALO_JOB_ID, HALO_TIMEOUT_MS,
 * HALO_BOOTSTRAP_TIMEOUT_MS), then defaults: rendezvous 127.0.0.1:29700
 * hosted by rank 0, no token (allowed on loopback only), job "halo",
 * timeout 120 s, bootstrap timeout 60 s. HALO_RENDEZVOUS_EXTERNAL,
 * HALO_JOB_ATTEMPT, HALO_DETECT_PEER_FAILURE, HALO_SPIN_POLLS,
 * HALO_TRANSFER and HALO_CUDA_DRIVER (halo_exchange_start) have no field
 * and come from the environment only.
 * Durations are milliseconds (5000) or carry a unit (500ms, 2s); switches
 * are 1/true/yes/on or 0/false/no/off. A value that cannot be read fails
 * halo_comm_create with HALO_ERR_INVALID_ARGUMENT. README.md lists them all.
 */
typedef struct halo_comm_params {
    uint64_t         field_mask;
    halo_bootstrap_t bootstrap;
    const char      *rendezvous;           /**< "host:port" */
    const char      *token;                /**< shared secret of the job */
    const char      *job_id;
    int64_t          timeout_ms;           /**< deadline of every wait in forward/backward/plan create */
    int64_t          bootstrap_timeout_ms; /**< deadline of the rendezvous */
} halo_comm_params_t;

/** @brief halo_comm_params_t with no field set: `halo_comm_params_t p = HALO_COMM_PARAMS_INITIALIZER;` */
#define HALO_COMM_PARAMS_INITIALIZER {0, HALO_BOOTSTRAP_RENDEZVOUS, NULL, NULL, NULL, 0, 0}

/** @brief Bits of halo_plan_params_t.field_mask. */
enum {
    HALO_PLAN_PARAM_X_STRIDES        = 1u << 0,
    HALO_PLAN_PARAM_OUT_STRIDES      = 1u << 1,
    HALO_PLAN_PARAM_GRAD_OUT_STRIDES = 1u << 2,
    HALO_PLAN_PARAM_GRAD_X_STRIDES   = 1u << 3,
    HALO_PLAN_PARAM_PADDING          = 1u << 4,
    HALO_PLAN_PARAM_HALOS_ONLY       = 1u << 5,
    HALO_PLAN_PARAM_LEFT_STRIDES     = 1u << 6,
    HALO_PLAN_PARAM_RIGHT_STRIDES    = 1u << 7,
    HALO_PLAN_PARAM_GRAD_LEFT_STRIDES  = 1u << 8,
    HALO_PLAN_PARAM_GRAD_RIGHT_STRIDES = 1u << 9,
    HALO_PLAN_PARAM_MEMORY_TYPE        = 1u << 10,
    /** Not a field: create the plan without meeting the other ranks (see
     * halo_plan_create). */
    HALO_PLAN_PARAM_DEFERRED           = 1u << 11
};

/**
 * @brief A tensor layout. dtype, ndim, shape, dim, left and right are always
 * read; the rest only when their field_mask bit is set. Strides are in
 * elements; unset strides mean contiguous. out and grad_out have x's shape
 * with left + right more slices along dim; grad_out's strides default to
 * out's, grad_x's to x's. Shards may differ in length along dim between
 * ranks; every other field must agree on all ranks. padding (zeros unless
 * HALO_PLAN_PARAM_PADDING is set) fills the slots beyond the sequence's ends.
 *
 * A halos-only plan (halos_only = 1) has no padded tensors: its forward
 * writes the left and right halos into tensors of their own (x's shape with
 * left, respectively right, slices along dim; strides left_strides and
 * right_strides), and its backward sends the halo gradients from grad_left
 * and grad_right (strides default to left's and right's) and adds the
 * neighbours' gradients into grad_x, which already holds the rest of x's
 * gradient. Ranks may mix padded and halos-only plans of the same layout.
 *
 * memory_type (default HALO_MEMORY_HOST) says where every tensor of the
 * plan lives; all ranks must agree on it. A HALO_MEMORY_CUDA plan moves
 * bytes only, straight between the device pointers and the transport
 * (GPUDirect, cuda_ipc), and leaves all local work to the caller: it must
 * be halos-only with HALO_PAD_ZEROS padding; its forward leaves the halo
 * slices outside the global sequence as they were (the caller fills them
 * with zeros); its backward
 * *writes* each neighbour's halo gradient into the slices of grad_x it
 * belongs to, leaving the other slices as they were, and the caller adds
 * them into x's gradient (the right neighbour's, for x's last left slices,
 * then the left neighbour's, for its first right slices: the reference
 * order). So every slice may go to one rank at most (halos no longer than
 * any shard, left + right no longer than any shard), else creation fails
 * with HALO_ERR_INVALID_ARGUMENT on every rank. The caller makes the data
 * ready before a call (synchronise the stream that wrote it). It needs a
 * transport that moves CUDA memory (halo_comm_memory_types): UCX built
 * with CUDA, as HPC-X is; with any other, creation fails with
 * HALO_ERR_INVALID_ARGUMENT on every rank, and the caller stages the
 * boundary slabs through a host plan instead (halocp does).
 */
typedef struct halo_plan_params {
    uint64_t       field_mask;
    halo_dtype_t   dtype;
    int32_t        ndim;             /**< 1 .. 8 */
    const int64_t *shape;            /**< ndim entries: the local shard x */
    int32_t        dim;              /**< the sharded (temporal) dimension */
    int64_t        left;             /**< halo slices before x along dim */
    int64_t        right;            /**< halo slices after x along dim */
    const int64_t *x_strides;
    const int64_t *out_strides;
    const int64_t *grad_out_strides;
    const int64_t *grad_x_strides;
    halo_padding_t padding;
    int32_t        halos_only;       /**< 1: a halos-only plan (see above) */
    const int64_t *left_strides;
    const int64_t *right_strides;
    const int64_t *grad_left_strides;
    const int64_t *grad_right_strides;
    halo_memory_type_t memory_type;  /**< HALO_MEMORY_HOST unless set */
} halo_plan_params_t;

/**
 * @brief halo_plan_params_t with no optional field set: a float32,
 * zero-padded, padded host plan; the caller still sets ndim, shape, dim,
 * left and right.
 */
#define HALO_PLAN_PARAMS_INITIALIZER \
    {0, HALO_FLOAT32, 0, NULL, 0, 0, 0, NULL, NULL, NULL, NULL, HALO_PAD_ZEROS, 0, NULL, NULL, NULL, NULL, HALO_MEMORY_HOST}

/** @brief Version of the loaded library, as HALO_VERSION_NUMBER. */
int halo_version_number(void);
/** @brief Version string of the loaded library, e.g. "0.3.0". */
const char *halo_version_string(void);

/** @brief A static description of a result code. */
const char *halo_strerror(halo_result_t result);

/**
 * @brief A HALO_* setting (the README's configuration table) as the library
 * reads it now: the process environment, else its default. For bindings,
 * which then never parse a setting by rules of their own. value (len bytes;
 * NULL with len 0 to skip) receives it as text, NUL-terminated; *number (NULL
 * to skip) receives it as a number where it is one: milliseconds for a
 * duration, 0 or 1 for a switch, the integer for a count, else 0. An unknown
 * name, a value the library refuses, or a value longer than len - 1 bytes is
 * HALO_ERR_INVALID_ARGUMENT, naming it. Local, any thread.
 */
halo_result_t halo_setting_get(const char *name, char *value, size_t len, int64_t *number);

/**
 * @brief The detailed message of the last failed call on this thread (which
 * rank, which peer, which shape), or "" if none failed. Valid until the next
 * failing call on this thread; the caller does not free it.
 */
const char *halo_last_error(void);

/**
 * @brief Create this rank's communicator. With the rendezvous bootstrap this
 * is collective and returns when all world_size ranks are connected.
 *
 * Ranks meet only ranks of the same job id, attempt and launch: the launch
 * is what the launcher gave every rank (torchrun's run id, Slurm's job and
 * step, Open MPI's job id, PMIx's namespace) and, for a job with no id,
 * attempt or token of its own on a loopback rendezvous, the parent process
 * that started the ranks. Rank 0 waits while another job's rendezvous holds
 * the address, and never joins a rendezvous it does not host. Two processes
 * with one rank, ranks that disagree on the world size, a rank that dies or
 * a peer address that is not a halo address fail with HALO_ERR_RENDEZVOUS on
 * every rank that is still there, naming the rank and the setting to change
 * (HALO_JOB_ID, HALO_JOB_ATTEMPT, HALO_RENDEZVOUS); README.md has the rule.
 * @param[in]  rank        0 .. world_size-1
 * @param[in]  world_size  ranks in the group
 * @param[in]  params      optional (NULL for defaults and environment)
 * @param[out] comm        the new communicator
 */
halo_result_t halo_comm_create(int rank, int world_size, const halo_comm_params_t *params, halo_comm_t *comm);

/**
 * @brief This rank's address, for HALO_BOOTSTRAP_EXTERNAL: opaque bytes
 * (the transport's address in halo's envelope, which names the rank, the
 * world size and the job, and carries a checksum). Hand them to every rank's
 * halo_comm_connect exactly as they are. They stay valid until the
 * communicator is destroyed.
 */
halo_result_t halo_comm_get_address(halo_comm_t comm, const void **address, size_t *length);

/**
 * @brief Connect with every rank's address (world_size entries, rank order,
 * this rank's own included), each exactly as halo_comm_get_address returned
 * it, for HALO_BOOTSTRAP_EXTERNAL. An address that was changed or cut on
 * the way, sits in another rank's slot, or comes from a communicator of
 * another world size or job (job id, attempt) fails with
 * HALO_ERR_INVALID_ARGUMENT naming the rank, before the transport sees it;
 * the communicator stays unconnected and connect may be called again.
 */
halo_result_t halo_comm_connect(halo_comm_t comm, const void *const *addresses, const size_t *lengths);

/** @brief This communicator's rank and world size. */
halo_result_t halo_comm_get_rank(halo_comm_t comm, int *rank, int *world_size);

/**
 * @brief Destroy a communicator and every plan made on it. Local; never hangs.
 * Peers are told: their later exchanges with this rank fail at once with
 * HALO_ERR_PEER_FAILED naming it. Its requests end: a later
 * halo_request_test or halo_request_wait on one fails with
 * HALO_ERR_INVALID_STATE naming the destroy (halo_request_free releases it).
 * A communicator belongs to the process that made it. In a process forked
 * from one that had loaded libhalo (Go's runtime does not survive a fork),
 * this, halo_plan_destroy and halo_request_free only return HALO_SUCCESS
 * (an atexit handler there tells the peers nothing), and every other call
 * fails at once with HALO_ERR_INVALID_STATE naming both processes: use
 * libhalo in a process started by exec.
 */
halo_result_t halo_comm_destroy(halo_comm_t comm);

/**
 * @brief Stop a communicator from any thread, for a watchdog that must end a
 * stuck exchange: every call in flight on it returns HALO_ERR_COMM_FAILED
 * within milliseconds, and so does every later call but halo_comm_destroy,
 * which is then immediate. Peers see this rank as failed: from the moment
 * the call in flight has ended, every exchange of theirs with it fails with
 * HALO_ERR_PEER_FAILED naming it, also one that matched what this rank sent
 * before it aborted. Idempotent.
 */
halo_result_t halo_comm_abort(halo_comm_t comm);

/**
 * @brief Create a plan, collectively: every rank calls it, in the same order
 * relative to its other collective calls (plan creations and exchanges).
 * Ranks exchange their layouts; any disagreement fails with
 * HALO_ERR_MISMATCH on every rank, naming the ranks and fields, and a rank
 * that cannot make its part (its staging cannot be allocated) fails creation
 * on every rank with its result code, naming it: creation ends alike
 * everywhere, and the communicator stays usable.
 *
 * With HALO_PLAN_PARAM_DEFERRED in params->field_mask, creation is local
 * (the layout is checked, nothing is sent) and the plan's first exchange
 * agrees. Every exchange carries the identity of the layout its rank runs as
 * agreed by all ranks (every rank's shard length included): ranks that come
 * to one exchange with different agreed layouts, or a rank with none yet,
 * learn it from that exchange's messages and agree again within it, so a
 * rank may create a plan whenever it meets a new shard shape while the
 * other ranks reuse theirs (a binding's plan cache). Ranks that truly
 * disagree (dtype, halos, padding, the other dims, forward against
 * backward) fail that exchange at once with HALO_ERR_MISMATCH on every rank.
 */
halo_result_t halo_plan_create(halo_comm_t comm, const halo_plan_params_t *params, halo_plan_t *plan);

/**
 * @brief Deprecated (0.3): halo_exchange(plan, HALO_DIR_FORWARD, {x, out}, 2,
 * NULL), which it calls. out = [left halo | x | right halo] along dim;
 * slices outside the global sequence are zeros. x may be the interior of out
 * (out + left slices, same strides): it is then not copied. Collective.
 */
HALO_DEPRECATED halo_result_t halo_plan_forward(halo_plan_t plan, const void *x, void *out);

/**
 * @brief Deprecated (0.3): halo_exchange(plan, HALO_DIR_BACKWARD, {grad_out,
 * grad_x}, 2, NULL). grad_x = interior of grad_out + the halo gradients of
 * the ranks that received x's slices, added in the tensor's dtype in the
 * reference order. grad_x may be the interior of grad_out. Collective.
 */
HALO_DEPRECATED halo_result_t halo_plan_backward(halo_plan_t plan, const void *grad_out, void *grad_x);

/**
 * @brief Deprecated (0.3): halo_exchange(plan, HALO_DIR_FORWARD, {x, left,
 * right}, 3, NULL). The halos-only forward: left and right receive the
 * slices before and after x in the global sequence (zeros outside it).
 * Collective.
 */
HALO_DEPRECATED halo_result_t halo_plan_halos_forward(halo_plan_t plan, const void *x, void *left, void *right);

/**
 * @brief Deprecated (0.3): halo_exchange(plan, HALO_DIR_BACKWARD, {grad_left,
 * grad_right, grad_x}, 3, NULL). The halos-only backward: sends grad_left
 * and grad_right to the ranks the halos came from, and adds the gradients of
 * x's slices that the neighbours send into grad_x, in the order and dtype of
 * halo_plan_backward, so that grad_x ends bit-identical to what the padded
 * backward computes when grad_x held grad_out's interior. Collective.
 */
HALO_DEPRECATED halo_result_t halo_plan_halos_backward(halo_plan_t plan, const void *grad_left, const void *grad_right, void *grad_x);

/**
 * @brief Deprecated (0.3): the asynchronous calls, kept unchanged so that
 * 0.3 callers keep working within major version 0 (a minor bump adds, never
 * removes); new code uses halo_exchange_start, of which they are the
 * stream-less special cases, but with no request: a *_start call takes the
 * same arguments as its blocking call, posts the messages, does the local
 * work that needs nothing from the wire (padding, the interior copy) and
 * returns; the exchange is then finished by halo_plan_wait, or by
 * halo_plan_test once it reports done. Results are in the tensors only when
 * the wait or test that finishes the exchange returns HALO_SUCCESS; until
 * then the tensors belong to the exchange. One exchange per plan and
 * direction may be in flight: a second start, a wait or test with nothing
 * started, and destroying a plan with an exchange in flight are
 * HALO_ERR_INVALID_STATE (the last one cancels the exchange and fails the
 * communicator). The blocking calls are a start followed by a wait.
 */
HALO_DEPRECATED halo_result_t halo_plan_forward_start(halo_plan_t plan, const void *x, void *out);
HALO_DEPRECATED halo_result_t halo_plan_backward_start(halo_plan_t plan, const void *grad_out, void *grad_x);
HALO_DEPRECATED halo_result_t halo_plan_halos_forward_start(halo_plan_t plan, const void *x, void *left, void *right);
HALO_DEPRECATED halo_result_t halo_plan_halos_backward_start(halo_plan_t plan, const void *grad_left, const void *grad_right, void *grad_x);

/**
 * @brief Deprecated (0.3): finishes the *_start calls above (a request's
 * exchange is finished by halo_request_test). Progress the exchange of the
 * direction without blocking; *done is
 * set to 1 (and the exchange finished) once its messages have all arrived,
 * else to 0. Communication advances only inside halo library calls: a
 * caller that computes between start and wait gains by testing now and then.
 * A test never blocks: where the exchange's messages came from ranks that
 * ran another agreed layout (see halo_plan_create), it posts the agreement
 * and reports not done, and later tests and waits of any exchange on the
 * communicator carry it on and rerun the exchange. Waits and tests of the
 * exchanges in flight on a communicator may come in any order, and in
 * different orders on different ranks: a call that cannot go on progresses
 * the others, so a peer blocked in one of them is never left waiting.
 */
HALO_DEPRECATED halo_result_t halo_plan_test(halo_plan_t plan, halo_direction_t direction, int *done);

/**
 * @brief Deprecated (0.3): finishes the *_start calls above (a request's
 * exchange is finished by halo_request_wait). Finish the exchange of the
 * direction, within the communicator's timeout, progressing the
 * communicator's other exchanges in flight while it waits (see
 * halo_plan_test). Once the communicator has failed (an abort, a failed
 * exchange), this and halo_plan_test return HALO_ERR_COMM_FAILED, also
 * after the call that reported the failure. An exchange begun by
 * halo_exchange_start belongs to its request: halo_plan_wait and
 * halo_plan_test refuse it with HALO_ERR_INVALID_STATE (finish it with
 * halo_request_wait or test).
 */
HALO_DEPRECATED halo_result_t halo_plan_wait(halo_plan_t plan, halo_direction_t direction);

/**
 * @brief Create one plan over count layouts (1 .. 16), collectively like
 * halo_plan_create: every call on it then exchanges all of them, with one
 * message per peer and direction carrying every layout's slabs. The layouts
 * are all padded or all halos-only; each has its own dtype, shape, dim and
 * halo sizes, agreed on by every rank as for a single plan (a mismatch names
 * the layout). The single-layout calls refuse such a plan; use the *_multi
 * calls, whose tensor arguments are arrays of count pointers, one per layout,
 * in the order of params. halo_plan_test and halo_plan_wait finish their
 * *_start forms as for any plan. The *_multi calls are deprecated (0.3):
 * halo_exchange and halo_exchange_start take every layout's tensors in one
 * array, and the blocking *_multi calls run as halo_exchange.
 */
halo_result_t halo_plan_create_multi(halo_comm_t comm, int count, const halo_plan_params_t *params, halo_plan_t *plan);
HALO_DEPRECATED halo_result_t halo_plan_forward_multi(halo_plan_t plan, const void *const *x, void *const *out);
HALO_DEPRECATED halo_result_t halo_plan_backward_multi(halo_plan_t plan, const void *const *grad_out, void *const *grad_x);
HALO_DEPRECATED halo_result_t halo_plan_halos_forward_multi(halo_plan_t plan, const void *const *x, void *const *left, void *const *right);
HALO_DEPRECATED halo_result_t halo_plan_halos_backward_multi(halo_plan_t plan, const void *const *grad_left, const void *const *grad_right,
                                             void *const *grad_x);
HALO_DEPRECATED halo_result_t halo_plan_forward_multi_start(halo_plan_t plan, const void *const *x, void *const *out);
HALO_DEPRECATED halo_result_t halo_plan_backward_multi_start(halo_plan_t plan, const void *const *grad_out, void *const *grad_x);
HALO_DEPRECATED halo_result_t halo_plan_halos_forward_multi_start(halo_plan_t plan, const void *const *x, void *const *left, void *const *right);
HALO_DEPRECATED halo_result_t halo_plan_halos_backward_multi_start(halo_plan_t plan, const void *const *grad_left,
                                                   const void *const *grad_right, void *const *grad_x);

/**
 * @brief Start one exchange of a plan: the direction's exchange of every
 * layout of the plan, single or multi (halo_plan_create_multi), padded or
 * halos-only, through this one call.
 *
 * buffers holds count pointers: for each layout in the order of the plan's
 * params, the tensors of the direction's exchange in this order —
 *   padded forward:      x, out
 *   padded backward:     grad_out, grad_x
 *   halos-only forward:  x, left, right
 *   halos-only backward: grad_left, grad_right, grad_x
 * so count is 2 or 3 times the number of layouts (anything else fails with
 * HALO_ERR_INVALID_ARGUMENT saying what was expected). The pointers are
 * those of the blocking calls above, with the same rules.
 *
 * stream NULL: the exchange is posted on the calling thread, with the local
 * work that needs nothing from the wire done before returning (as the
 * halo_plan_*_start calls).
 *
 * stream non-NULL (a CUstream, or a cudaStream_t, which is the same; CUDA's
 * default stream, whose handle is 0, is given as CU_STREAM_LEGACY, 0x1): the
 * exchange is ordered on that stream and the call returns at once, without
 * waiting for the stream (the handle is only passed on, never dereferenced,
 * so any non-NULL value the driver takes is fine, small ones included). It
 * blocks only where the driver does, while the stream's queue of commands
 * is full, until the exchanges ahead of it have ended; halo_comm_abort ends
 * such a start, and every later one, with HALO_ERR_COMM_FAILED. The exchange begins after the work queued on the
 * stream before the call (an event recorded there, waited for by a proxy
 * thread of the communicator), and work queued on the stream after the call
 * waits for it to end (the stream waits, with cuStreamWaitValue32, on a flag
 * the proxy writes). The tensors belong to the exchange until then. The
 * CUDA driver (libcuda.so.1) is loaded on first use: where it cannot be
 * loaded, or lacks a call halo needs, this fails with
 * HALO_ERR_INVALID_ARGUMENT naming the library and the reason. The proxy
 * runs the stream-ordered exchanges of a communicator in the order they were
 * started. A call that works on the host (plan creation, halo_comm_connect,
 * a blocking exchange or a start, test or wait without a stream) made while
 * some are queued first waits for them to end, so that every rank runs its
 * exchanges in the order of its calls (a test reports not done meanwhile);
 * halo_plan_destroy and halo_comm_destroy likewise wait for the exchanges
 * queued (halo_comm_abort makes them fail at once).
 * HALO_CUDA_DRIVER=host-fake (read by halo_comm_create) replaces the
 * driver with a host emulation (streams are FIFO queues run by host
 * threads, any non-NULL value names one): the proxy path on host memory,
 * for tests where there is no GPU. The first stream-ordered call loads the
 * driver for the whole process.
 *
 * One exchange per plan and direction may be in flight (a second start is
 * HALO_ERR_INVALID_STATE). *request is written only on success; the request
 * is finished by halo_request_test or halo_request_wait and released by
 * halo_request_free. Collective: every rank starts the same exchanges of its
 * plans in the same order.
 */
halo_result_t halo_exchange_start(halo_plan_t plan, halo_direction_t direction, void *const *buffers, size_t count,
                                  void *stream, halo_request_t *request);

/**
 * @brief Run one exchange of a plan and return when it has ended, with its
 * result: halo_exchange_start with the same arguments, halo_request_wait
 * (request, NULL) and halo_request_free, without the request. Collective,
 * as the start. Every other blocking exchange of this header is this call.
 *
 * stream NULL: on the calling thread. stream non-NULL: ordered on that
 * stream as halo_exchange_start orders it (it begins after the work queued
 * there before the call, and later work waits for it; the caller need not
 * synchronise the stream first), while the calling thread waits for it to
 * end. For an exchange that the host does not wait for, use
 * halo_exchange_start and halo_request_wait(request, stream).
 *
 * Its arguments are positional, NCCL's way, rather than a params struct
 * with a field mask (UCX's ucp_request_param_t): what varies per layout
 * (dtype, strides, padding, memory type, halos-only) is fixed by the plan,
 * whose params struct can grow; per call there are only the direction, the
 * tensors and where to order the exchange, and a new axis of that kind
 * (more tensors, another device) fits the buffers array or the plan.
 */
halo_result_t halo_exchange(halo_plan_t plan, halo_direction_t direction, void *const *buffers, size_t count, void *stream);

/**
 * @brief Progress the request without blocking: *done is 1 once its exchange
 * has ended (for a stream-ordered one: the proxy has written its flag), else
 * 0. The exchange's error, if any, is returned once it has ended, on every
 * call until the request is freed.
 */
halo_result_t halo_request_test(halo_request_t request, int *done);

/**
 * @brief Finish the request. stream NULL: block the calling thread until the
 * exchange ends (within the communicator's timeout) and return its result.
 * stream non-NULL (a stream-ordered request only): make that stream, which
 * may differ from the one the exchange was started on, wait for the
 * exchange, and return at once; an error of the exchange is then reported by
 * halo_request_test or a host wait.
 */
halo_result_t halo_request_wait(halo_request_t request, void *stream);

/**
 * @brief Release a request, as ucp_request_free does: the handle is invalid
 * from now on, and a request whose exchange has not ended is released when
 * it ends. If its exchange fails and the caller was not told so (by
 * halo_request_test or a host halo_request_wait), the next exchange on the
 * communicator that starts once the failure is known (any host call waits
 * for the queued stream-ordered ones first, so it always knows) returns that
 * failure instead of running, once, saying that what a stream read of the
 * freed exchange's results is not valid; an exchange that fails its
 * communicator makes every later call fail with HALO_ERR_COMM_FAILED as
 * well. Its tensors belong to the exchange until it has ended: a stream-ordered
 * one ends on the proxy, ahead of the later work of its stream (and of the
 * streams told to wait for it); one without a stream is finished by the
 * next call on the communicator that blocks on the host (a blocking
 * exchange, a start, a host wait, a plan's creation), and progressed by
 * halo_request_test of another request. halo_plan_destroy cancels it, as
 * any exchange in flight on the plan.
 */
halo_result_t halo_request_free(halo_request_t request);

/**
 * @brief Destroy a plan. Local. An exchange still in flight is cancelled and
 * reported as HALO_ERR_INVALID_STATE; the plan is destroyed all the same.
 */
halo_result_t halo_plan_destroy(halo_plan_t plan);

/**
 * @brief The memory types the communicator's transport sends from and
 * receives into itself: *types gets bit (1 << HALO_MEMORY_*) set for each.
 * HALO_MEMORY_HOST always; HALO_MEMORY_CUDA where UCX was built with CUDA
 * support and finds a GPU. Local; valid before connect.
 */
halo_result_t halo_comm_memory_types(halo_comm_t comm, uint64_t *types);

#ifdef __cplusplus
}
#endif

#endif /* HALO_H */
