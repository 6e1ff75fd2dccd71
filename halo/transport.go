package halo

import "time"

// Transport is what the algorithm needs from the wire: tagged, non-blocking,
// batched point-to-point messages between the ranks of one group. The UCX
// implementation lives in ucx/ (adapted in comm/); memtransport.go is an
// in-process one for tests.
//
// The model is "prepare once, run every step": a plan describes its messages
// once, as offsets into numbered base buffers, and each call only supplies the
// base addresses. That keeps per-step work (and cgo crossings) to a minimum.
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

// Segment is a byte range at an offset from an Op's base buffer.
type Segment struct {
	Off int64
	Len int64
}

// Op is one tagged message. A receive matches only a message from its Peer
// with its Tag (the transport carries the sender), in the order they were
// sent; it must arrive with exactly the total length of its segments, and
// anything else is an error naming the peer.
type Op struct {
	Peer int
	Tag  uint64
	Send bool
	Base int // index into the bases passed to Batch.Post
	Segs []Segment
}

// Batch is a prepared list of operations.
type Batch interface {
	// Post starts every operation, with the given base addresses.
	Post(bases []uintptr) error
	// Wait progresses until every posted operation has completed or the
	// deadline has passed; on failure it names the peers and operations
	// still pending. After a failed Wait the transport is unusable.
	Wait(deadline time.Time) error
	Close() error
}
