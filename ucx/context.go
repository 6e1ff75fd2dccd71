package ucx

/*
#cgo LDFLAGS: -lucp -lucs -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include "helpers.h"

// The file libucp was loaded from (NULL if the loader cannot say).
static const char *hux_ucp_path(void) {
    Dl_info info;
    if (dladdr((void *)ucp_get_version_string, &info) == 0) {
        return NULL;
    }
    return info.dli_fname;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

// Options configure Open. The zero value is the default, and what halo's
// communicators use unless told otherwise: no peer error handling, because in
// UCX 1.13 it costs the single-copy CMA transport on shared memory (2 MiB
// halos take 400 us instead of 200-265 us, bench/RESULTS.md); a dead peer is
// then noticed at the deadline.
type Options struct {
	// PeerErrorHandling creates endpoints in UCP_ERR_HANDLING_MODE_PEER, so
	// that a dead or unreachable peer fails its operations with
	// ErrPeerFailed instead of leaving them to the deadline. UCX 1.13 drops
	// its posix and sysv shared-memory transports from such endpoints unless
	// their error handling is switched on (UCX_POSIX_ERROR_HANDLING,
	// UCX_SYSV_ERROR_HANDLING), so Open switches it on unless either
	// variable is in the environment. UCX 1.13 still misses a dead
	// shared-memory peer while a rendezvous send to it is outstanding; the
	// deadline catches that (see NOTES.md).
	PeerErrorHandling bool

	// KeepaliveInterval is how often UCX checks that peers are alive
	// (UCX_KEEPALIVE_INTERVAL), with PeerErrorHandling only: about how
	// long a dead peer goes unnoticed. Zero means DefaultKeepalive; the
	// environment wins over this field.
	KeepaliveInterval time.Duration

	// SpinPolls is how many consecutive idle progress calls Wait makes
	// before it starts yielding the CPU between polls. Zero means
	// DefaultSpinPolls, a negative value never stops spinning.
	SpinPolls int

	// SleepAfter is how long a Wait yields, idle, before it sleeps on the
	// worker's event fd (UCP_FEATURE_WAKEUP) until UCX has something to do.
	// Zero means DefaultSleepAfter; a negative value never sleeps, and
	// then the worker is made without wakeup support.
	SleepAfter time.Duration

	// Config sets further UCX options by name, with or without the UCX_
	// prefix (e.g. "TLS": "shm,self"). These win over the environment.
	Config map[string]string
}

// DefaultSpinPolls is Options.SpinPolls when it is zero: an idle poll costs
// 10-20 ns on shared memory, so Wait spins for about a millisecond before it
// begins to yield. Yielding sooner measured worse on a shared two-core
// machine, even with four processes on it (see NOTES.md).
const DefaultSpinPolls = 65536

// abortGrace is how long an aborting Wait or Close lets cancelled or
// unfinished operations complete before it force-closes their endpoints.
const abortGrace = 20 * time.Millisecond

// DefaultSleepAfter is Options.SleepAfter when it is zero. Sleeping as soon
// as the spin runs out measured worse than yielding with 4 ranks on 2 CPUs
// (2 KiB p50 about 350 us against 100 us: a sleeping rank is woken later than
// a yielding one gets the CPU back), so only waits idle for a millisecond,
// such as waits for a peer that is still computing, sleep.
const DefaultSleepAfter = time.Millisecond

// DefaultKeepalive is Options.KeepaliveInterval when it is zero: a dead
// peer is noticed within about a second (UCX's own default is 20 s).
const DefaultKeepalive = time.Second

// Version is the version of the UCX library in use (ucp_get_version_string).
func Version() string {
	return C.GoString(C.ucp_get_version_string())
}

// LibraryPath is the file the UCX library in use was loaded from (libucp's,
// as the loader resolved it): which of several installed UCX builds runs.
func LibraryPath() string {
	if p := C.hux_ucp_path(); p != nil {
		return C.GoString(p)
	}
	return "(unknown)"
}

// versionNumber is the loaded UCX's major and minor version (ucp_get_version),
// which the address walk needs: the layout changed across releases.
func versionNumber() (major, minor int) {
	var ma, mi, re C.uint
	C.ucp_get_version(&ma, &mi, &re)
	return int(ma), int(mi)
}

// Open creates a UCP context (tag matching only) and one worker for rank of
// a group of size ranks. Connect it to its peers before posting.
func Open(rank, size int, opts Options) (*Transport, error) {
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("ucx: open: rank %d of %d is out of range", rank, size)
	}
	if size > 1<<20 {
		return nil, fmt.Errorf("ucx: open: group of %d ranks is too large", size)
	}
	c := C.hux_transport_new(C.int(rank), C.int(size))
	if c == nil {
		return nil, statusError("open", C.UCS_ERR_NO_MEMORY)
	}
	spin := opts.SpinPolls
	if spin == 0 {
		spin = DefaultSpinPolls
	}
	c.spin = C.int(max(spin, -1))
	if opts.SleepAfter == 0 {
		opts.SleepAfter = DefaultSleepAfter
	}
	c.sleep_ns = C.int64_t(max(opts.SleepAfter, -1))
	c.grace_ns = C.int64_t(abortGrace)

	t := &Transport{
		c:          c,
		rank:       rank,
		size:       size,
		rankBits:   rankBits(size),
		peerMode:   opts.PeerErrorHandling,
		sleepAfter: opts.SleepAfter,
		batches:    make(map[*Batch]struct{}),
	}
	if err := t.initContext(opts); err != nil {
		C.hux_transport_destroy(c)
		return nil, err
	}
	if err := t.initWorker(); err != nil {
		C.hux_transport_destroy(c)
		return nil, err
	}
	// After ucp_init, which may load UCX modules: from here on UCX installs
	// no handlers.
	reclaimSignals()
	return t, nil
}

// initContext reads UCX's configuration, applies opts and calls ucp_init.
func (t *Transport) initContext(opts Options) error {
	var cfg *C.ucp_config_t
	if st := C.hux_config_read(&cfg); st != C.UCS_OK {
		return statusError("ucp_config_read", st)
	}
	defer C.ucp_config_release(cfg)

	if err := applyConfig(cfg, opts); err != nil {
		return err
	}
	if st := C.hux_init(cfg, C.int(t.size), cbool(t.sleepAfter >= 0), &t.c.context); st != C.UCS_OK {
		t.c.context = nil
		return statusError("ucp_init", st)
	}
	var types C.uint64_t
	if st := C.hux_context_memory_types(t.c.context, &types); st != C.UCS_OK {
		return statusError("ucp_context_query", st)
	}
	t.memoryTypes = uint64(types)
	return nil
}

// ucsMemory is the ucs_memory_type_t of each of halo's memory types.
var ucsMemory = map[transport.Memory]C.ucs_memory_type_t{
	transport.Host: C.UCS_MEMORY_TYPE_HOST,
	transport.CUDA: C.UCS_MEMORY_TYPE_CUDA,
}

// Moves says whether the context's transports send from and receive into
// memory of type m: CUDA only where UCX was built with CUDA support (HPC-X,
// --with-cuda) and its CUDA modules load.
func (t *Transport) Moves(m transport.Memory) bool {
	u, ok := ucsMemory[m]
	return ok && t.memoryTypes&(1<<u) != 0
}

// MemoryTypes names every memory type the context moves, as UCX names them
// ("host", "cuda", "cuda-managed", ...).
func (t *Transport) MemoryTypes() []string {
	// An array of unknown size in C: cgo gives it none.
	all := unsafe.Slice((**C.char)(unsafe.Pointer(&C.ucs_memory_type_names)), C.UCS_MEMORY_TYPE_LAST)
	var names []string
	for u, name := range all {
		if t.memoryTypes&(1<<u) != 0 {
			names = append(names, C.GoString(name))
		}
	}
	return names
}

func applyConfig(cfg *C.ucp_config_t, opts Options) error {
	var set []string // name, value pairs
	defaults := func(name, value string) {
		if _, ok := os.LookupEnv("UCX_" + name); !ok {
			set = append(set, name, value)
		}
	}
	if opts.PeerErrorHandling {
		// UCX_POSIX_ERROR_HANDLING and UCX_SYSV_ERROR_HANDLING are one
		// field of the shared-memory (mm) interface table, which
		// ucp_config_modify names MM_ERROR_HANDLING; either variable in the
		// environment leaves the choice to the user.
		_, posix := os.LookupEnv("UCX_POSIX_ERROR_HANDLING")
		_, sysv := os.LookupEnv("UCX_SYSV_ERROR_HANDLING")
		if !posix && !sysv {
			defaults("MM_ERROR_HANDLING", "y")
		}
		keepalive := opts.KeepaliveInterval
		if keepalive <= 0 {
			keepalive = DefaultKeepalive
		}
		defaults("KEEPALIVE_INTERVAL", fmt.Sprintf("%dus", max(keepalive.Microseconds(), 1)))
	}
	names := make([]string, 0, len(opts.Config))
	for name := range opts.Config {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		set = append(set, strings.TrimPrefix(name, "UCX_"), opts.Config[name])
	}

	for i := 0; i < len(set); i += 2 {
		name, value := C.CString(set[i]), C.CString(set[i+1])
		st := C.ucp_config_modify(cfg, name, value)
		C.free(unsafe.Pointer(name))
		C.free(unsafe.Pointer(value))
		if st != C.UCS_OK {
			return fmt.Errorf("ucx: config %s=%q: %w", set[i], set[i+1], statusError("ucp_config_modify", st))
		}
	}
	return nil
}

// rankBits is how many top bits of a wire tag carry the sender's rank.
func rankBits(size int) int {
	n := 0
	for size-1 >= 1<<n {
		n++
	}
	return n
}

var errNotConnected = errors.New("ucx: transport is not connected")
