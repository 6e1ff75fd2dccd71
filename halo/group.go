package halo

import (
	"fmt"
	mbits "math/bits"
	"sync/atomic"
	"time"

	"github.com/halo-cp/halo/halo/transport"
)

// DefaultTimeout bounds every wait unless the caller sets another deadline:
// long enough for ranks that reach an exchange at different times in a
// training step, short enough that a dead peer is noticed.
const DefaultTimeout = 120 * time.Second

// Transfer chooses how a slab that is not one contiguous range goes on the wire.
type Transfer int

const (
	TransferAuto Transfer = iota // IOV for few large segments, else pack (measured: bench/RESULTS.md)
	TransferPack                 // always gather into a staging buffer
	TransferIOV                  // always send the caller's segments as a UCX IOV
)

// GroupOptions tune a Group; the zero value is the default.
type GroupOptions struct {
	Timeout  time.Duration // per wait; 0 means DefaultTimeout
	Transfer Transfer
	// IOVMinSegment is the average segment size, in bytes, from which
	// TransferAuto sends segments in place; 0 means the measured default.
	IOVMinSegment int64
	// IOVMaxSegments caps the segments of one IOV message; 0 means default.
	IOVMaxSegments int
}

const (
	defaultIOVMinSegment  = 4 << 10
	defaultIOVMaxSegments = 1024
)

// Group is the algorithm's view of a communicator: a transport and the plans
// made on it. Plans are created collectively, in the same order on every
// rank. A Group and its plans are used by one goroutine at a time.
type Group struct {
	t        transport.Transport
	exec     executor
	opts     GroupOptions
	nextPlan uint32                // handle numbers, local to this rank (messages only)
	seq      uint64                // the last collective call's number (see tag)
	failed   atomic.Pointer[error] // the first failure; an Abort on another thread may set it
}

// NewGroup wraps a connected transport.
func NewGroup(t transport.Transport, opts GroupOptions) (*Group, error) {
	if t == nil {
		return nil, fmt.Errorf("%w: nil transport", ErrInvalid)
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("%w: timeout %v is negative", ErrInvalid, opts.Timeout)
	}
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.IOVMinSegment <= 0 {
		opts.IOVMinSegment = defaultIOVMinSegment
	}
	if opts.IOVMaxSegments <= 0 {
		opts.IOVMaxSegments = defaultIOVMaxSegments
	}
	return &Group{t: t, exec: cpu{}, opts: opts, nextPlan: 1}, nil
}

func (g *Group) Rank() int { return g.t.Rank() }
func (g *Group) Size() int { return g.t.Size() }

// Err is the failure that made the group unusable, or nil. Read on every
// call: atomic rather than a mutex (measured: a tenth of a 2 KiB call's
// Go-side time went to the lock).
func (g *Group) Err() error {
	if p := g.failed.Load(); p != nil {
		return *p
	}
	return nil
}

// fail records the first transport failure: after it the wire is in an
// unknown state (sends cannot be cancelled), so every later call refuses.
func (g *Group) fail(err error) error {
	g.failed.CompareAndSwap(nil, &err)
	return err
}

// Abort makes every later call on the group fail with ErrFailed; safe from
// any goroutine. (An exchange in flight is woken by aborting the transport.)
func (g *Group) Abort() {
	g.fail(fmt.Errorf("%w: aborted (halo_comm_abort)", ErrFailed))
}

func (g *Group) usable() error {
	if err := g.Err(); err != nil {
		return fmt.Errorf("%w: an earlier exchange failed (%v); destroy and recreate the communicator", ErrFailed, err)
	}
	return nil
}

// Tags: a call's number (20 bits) | phase (4 bits) | the identity of the
// agreed layout the sender runs (the rest, under the transport's rank bits).
//
// Every rank numbers the collective calls on a group alike (plan creations
// and exchange starts, in program order), and receives match on the
// number only: whatever plan a peer runs, its messages of the same call
// meet ours, and their tags say whether it runs the same agreed layout
// (identity) and the same call (phase). A rank that finds another layout
// or none re-agrees with every rank in that same call (agree.go), where
// matching on plan numbers would wait for messages never sent. Messages
// between two ranks within one call are matched in the order sent.
const (
	seqBits    = 20
	seqMask    = 1<<seqBits - 1
	phaseShift = seqBits
	identShift = seqBits + 4

	phaseSetup    = 1 // a rank's layout records
	phaseForward  = 2
	phaseBackward = 3
	phaseOutcome  = 4 // each rank's result of making its part of a plan

	identNone = 0 // no agreed layout yet (a deferred plan before its first call)
)

func (g *Group) tag(ident uint64, phase int) uint64 {
	return ident<<identShift | uint64(phase)<<phaseShift
}

// identOf turns the hash of an agreement into the identity its messages
// carry: as many bits as the transport leaves (at least 30 for groups of
// up to 1024 ranks), never identNone.
func (g *Group) identOf(hash uint64) uint64 {
	bits := 64 - identShift - mbits.Len(uint(g.Size()-1))
	return 1 + hash%(1<<bits-1)
}

// nextSeq numbers a collective call.
func (g *Group) nextSeq() uint64 {
	g.seq = (g.seq + 1) & seqMask
	return g.seq
}
