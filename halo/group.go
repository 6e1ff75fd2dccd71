package halo

import (
	"fmt"
	mbits "math/bits"
	"runtime"
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
	opts     GroupOptions
	nextPlan uint32                // handle numbers, local to this rank (messages only)
	seq      uint64                // the last collective call's number (see tag)
	failed   atomic.Pointer[error] // the first failure; an Abort on another thread may set it
	inflight []*dirCall            // the exchanges started and not yet finished, in the order started
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
	return &Group{t: t, opts: opts, nextPlan: 1}, nil
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

// unlist removes dc from the exchanges in flight (most often the last one
// started, or the only one).
func (g *Group) unlist(dc *dirCall) {
	for i := len(g.inflight) - 1; i >= 0; i-- {
		if g.inflight[i] == dc {
			n := len(g.inflight) - 1
			copy(g.inflight[i:], g.inflight[i+1:])
			g.inflight[n] = nil
			g.inflight = g.inflight[:n]
			return
		}
	}
}

// quietBut says whether every exchange in flight on the group other than
// self needs nothing more from this rank's wire: each is ready (every peer
// ran the same instance, only its local completion is left) or has ended.
// Then a blocking call may use the transport's own wait; otherwise it
// polls, and progresses the others while it waits (block).
func (g *Group) quietBut(self *dirCall) bool {
	for _, dc := range g.inflight {
		if dc != self && !dc.ready && dc.err == nil {
			return false
		}
	}
	return true
}

// progressOthers advances every exchange in flight but self without
// blocking (Plan.progress): a peer blocked in one of them, in its agreement
// above all, gets what it waits for from this rank even while this rank
// waits for, or polls, another. What ends one of them is its own caller's
// to hear; a failure of the wire is returned, since it ends every call.
func (g *Group) progressOthers(self *dirCall) error {
	for i := 0; i < len(g.inflight); i++ {
		if dc := g.inflight[i]; dc != self {
			dc.p.progress(dc)
		}
	}
	return g.Err()
}

// block runs step until it reports done or an error, for a call that the
// caller asked to block (a Wait, a blocking exchange, a plan's creation);
// self is its exchange, if it is one. While step cannot go on, the other
// exchanges in flight are progressed too: ranks that finish their exchanges
// in different orders each answer the call their peer blocks in. When
// nothing else needs this rank, it blocks in wait (the transport's wait on
// what step waits for). The timeout counts from the last stage that moves
// reports passed, like a wait per stage.
func (g *Group) block(self *dirCall, step func() (bool, error), wait func(time.Duration) error, moves func() int) error {
	var deadline time.Time
	last := moves()
	for spins := 0; ; spins++ {
		if done, err := step(); done || err != nil {
			return err
		}
		if g.quietBut(self) {
			if err := wait(g.opts.Timeout); err != nil {
				return err
			}
			continue
		}
		if err := g.progressOthers(self); err != nil {
			return err
		}
		if m := moves(); m != last {
			last, deadline, spins = m, time.Time{}, 0
		}
		switch now := time.Now(); {
		case deadline.IsZero():
			deadline = now.Add(g.opts.Timeout)
		case now.After(deadline):
			// The transport's wait, at once out of time, says what is
			// still pending and cleans up as after any timeout.
			if err := wait(time.Nanosecond); err != nil {
				return err
			}
			deadline = time.Time{}
		}
		// Spinning ranks share the machine's CPUs with their peers (and
		// tests run many ranks in one process): yield, and after a while
		// sleep a little between polls.
		if spins < 1000 {
			runtime.Gosched()
		} else {
			time.Sleep(20 * time.Microsecond)
		}
	}
}
