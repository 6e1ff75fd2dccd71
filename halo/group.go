package halo

import (
	"fmt"
	"sync"
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
	nextPlan uint32
	mu       sync.Mutex // guards failed, which a Close on another thread may read
	failed   error
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

// Err is the failure that made the group unusable, or nil.
func (g *Group) Err() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.failed
}

// fail records the first transport failure: after it the wire is in an
// unknown state (sends cannot be cancelled), so every later call refuses.
func (g *Group) fail(err error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.failed == nil {
		g.failed = err
	}
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

// Tags: plan number (24 bits) | phase (8 bits). The transport matches a
// receive only with messages from its peer, so the sender is not in the tag;
// the plan number keeps concurrent plans apart. Messages between two ranks
// with the same tag are matched in order, so no step counter is needed.
const (
	phaseSetup    = 1
	phaseForward  = 2
	phaseBackward = 3
)

func tag(plan uint32, phase int) uint64 {
	return uint64(plan&0xffffff)<<8 | uint64(phase&0xff)
}
