package halo

import "errors"

// Error classes. Every error that a Group, a Plan or a communicator built on
// them returns matches exactly one of these with errors.Is; the message
// always says more (which rank, which peer, which shape). The C ABI maps each
// class to one result code, halocp to one HaloError code, so a class is
// defined here once and nowhere else.
var (
	// ErrInvalid: a bad argument (a NULL pointer, a shape, a dim, a value).
	ErrInvalid = errors.New("invalid argument")
	// ErrMismatch: ranks disagree on a plan; every rank reports the same.
	ErrMismatch = errors.New("ranks disagree")
	// ErrTimeout: a deadline passed while operations were pending.
	ErrTimeout = errors.New("timed out")
	// ErrPeerFailed: a peer is gone (dead, unreachable, its endpoint closed).
	ErrPeerFailed = errors.New("peer failed")
	// ErrFailed: the communicator failed earlier and refuses further work.
	ErrFailed = errors.New("communicator failed")
	// ErrClosed: the plan or communicator was closed.
	ErrClosed = errors.New("closed")
	// ErrState: a call out of order (connect twice, plan before connect).
	ErrState = errors.New("invalid state")
	// ErrRendezvous: the ranks could not find each other.
	ErrRendezvous = errors.New("rendezvous failed")
	// ErrTransport: the wire reported another error.
	ErrTransport = errors.New("transport error")
	// ErrInternal: a bug in halo.
	ErrInternal = errors.New("internal error")
)

// Classes lists every class, for code that maps them (and its tests).
var Classes = []error{ErrInvalid, ErrMismatch, ErrTimeout, ErrPeerFailed, ErrFailed,
	ErrClosed, ErrState, ErrRendezvous, ErrTransport, ErrInternal}

// Classify returns err marked as belonging to class, with err's message
// unchanged: for errors from below (the wire, the rendezvous) whose own
// types know nothing of halo's classes. errors.Is and errors.As still see
// err and everything it wraps. A nil err stays nil.
func Classify(class, err error) error {
	if err == nil {
		return nil
	}
	return &classified{class: class, err: err}
}

type classified struct{ class, err error }

func (c *classified) Error() string   { return c.err.Error() }
func (c *classified) Unwrap() []error { return []error{c.class, c.err} }
