// Package transport is the contract between halo's algorithm and a wire:
// tagged, non-blocking, batched point-to-point messages between the ranks of
// one group. It is a leaf package so that the algorithm (halo), the UCX
// binding (ucx) and the in-process test transport (halo/halotest) share one
// definition of an operation without importing each other.
//
// The model is "prepare once, run every step": a plan describes its messages
// once, as offsets into numbered base buffers, and each call only supplies the
// base addresses. That keeps per-step work (and cgo crossings) to a minimum.
//
// Errors: an implementation's failures must match one of halo's error
// classes with errors.Is (halo.ErrTimeout, halo.ErrPeerFailed, ...); the UCX
// transport's are classed where comm adapts it.
package transport

import (
	"fmt"
	"time"
)

// Transport is one rank's end of a group's wire.
type Transport interface {
	Rank() int
	Size() int
	// Prepare registers a fixed list of operations. Receives are posted
	// before sends, each group in the order given.
	Prepare(ops []Op) (Batch, error)
	// Alloc returns n bytes of memory the transport can send from and
	// receive into (registered where that helps); freed by Free.
	Alloc(n int) (Buffer, error)
}

// Buffer is transport-owned memory, addressable from Go.
type Buffer interface {
	Addr() uintptr
	Bytes() []byte
	Free() error
}

// Segment is a byte range at an offset from one of the base buffers passed
// to Batch.Post. The segments of one message may lie in different buffers:
// that is how one message carries the slabs of several tensors.
type Segment struct {
	Base int // index into the bases passed to Batch.Post
	Off  int64
	Len  int64
}

// Memory is where a message's bytes live. The values are include/halo.h's
// halo_memory_type_t.
type Memory int32

const (
	Host Memory = 0 // the CPU's memory
	CUDA Memory = 1 // an NVIDIA GPU's memory: only the wire may touch it
)

func (m Memory) String() string {
	switch m {
	case Host:
		return "host"
	case CUDA:
		return "cuda"
	}
	return fmt.Sprintf("memory type %d", int32(m))
}

// MemoryTyped is implemented by a Transport that can move memory other
// than the host's: Moves says whether its operations may point into memory
// of type m (the operation's Memory). A Transport without it moves host
// memory only.
type MemoryTyped interface {
	Moves(m Memory) bool
}

// Moves says whether t can send from and receive into memory of type m.
func Moves(t Transport, m Memory) bool {
	if m == Host {
		return true
	}
	mt, ok := t.(MemoryTyped)
	return ok && mt.Moves(m)
}

// Op is one tagged message. A receive matches only a message from its Peer
// with its Tag (the transport carries the sender), in the order they were
// sent; it must arrive with exactly the total length of its segments, and
// anything else is an error naming the peer. One segment goes on the wire as
// contiguous memory, several as an I/O vector.
//
// A receive with a Match is loose: it matches the peer's next message whose
// tag agrees with Tag on the bits set in Match, whatever its other bits and
// its length (a longer one is cut to the segments); Batch.Received then
// says what came, and the caller judges it. That is how an exchange learns
// that a peer is in another plan without waiting for a message that will
// never come.
type Op struct {
	Peer   int
	Tag    uint64
	Match  uint64 // receives only: 0 matches every bit of Tag exactly
	Send   bool
	Segs   []Segment
	Memory Memory // where every segment lives (one type per message)
}

// Bytes is the total length of the operation's segments.
func (op *Op) Bytes() int64 {
	var n int64
	for _, s := range op.Segs {
		n += s.Len
	}
	return n
}

// Batch is a prepared list of operations.
type Batch interface {
	// Post starts every operation, with the given base addresses and
	// tagOr OR'ed into every operation's tag (and a loose receive's).
	Post(bases []uintptr, tagOr uint64) error
	// Wait progresses until every posted operation has completed or the
	// timeout has passed (a timeout, not a deadline: reading the clock
	// costs as much as a small message's overheads, so an implementation
	// may start the time late, or only when the wait is not over at once);
	// on failure it names the peers and operations still pending. After a
	// failed Wait the transport is unusable.
	Wait(timeout time.Duration) error
	// Test progresses without blocking; once every posted operation has
	// completed it reports done, with the error Wait would have returned.
	Test() (done bool, err error)
	// Received is what receive i (an index into Prepare's ops) got in the
	// last post that completed without error: the sender's tag and length.
	Received(i int) (tag uint64, n int64)
	// Close releases the batch; a batch still posted is cancelled first.
	Close() error
}
