package ucx

/*
#include "helpers.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

// Batch is a prepared list of operations, posted and waited for as a whole.
// Its operation descriptions (and I/O vectors) live in C memory until Close.
type Batch struct {
	t     *Transport
	c     *C.hux_batch_t // nil once closed
	ops   []C.hux_op_t   // over c.ops
	bases []C.uintptr_t  // over c.bases
	info  []opInfo       // same order as ops, for error messages
	at    []int          // at[i] is where Prepare's op i is in ops
	// posted is true from a Post until the Wait that ends it.
	posted bool
}

type opInfo struct {
	peer  int
	tag   uint64
	send  bool
	loose bool // a receive with a Match: any length, checked by the caller
	bytes int64
}

var (
	errNotPosted     = errors.New("ucx: wait: batch is not posted")
	errAlreadyPosted = errors.New("ucx: post: batch is already posted; Wait first")
	errZombie        = errors.New("ucx: post: UCX did not release this batch's last operations even after force-closing their endpoints; the batch can only be closed")
)

// Prepare checks and stores ops for repeated use. Receives are posted before
// sends, each group in the order given.
func (t *Transport) Prepare(ops []transport.Op) (*Batch, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c == nil {
		return nil, ErrClosed
	}

	order := make([]int, 0, len(ops))
	nsegs, nbases := 0, 0
	for i, op := range ops {
		if err := t.checkOp(op); err != nil {
			return nil, fmt.Errorf("ucx: prepare: op %d: %w", i, err)
		}
		if !op.Send {
			order = append(order, i)
		}
		if len(op.Segs) > 1 {
			nsegs += len(op.Segs)
		}
		for _, s := range op.Segs {
			nbases = max(nbases, s.Base+1)
		}
	}
	for i, op := range ops {
		if op.Send {
			order = append(order, i)
		}
	}

	c := C.hux_batch_new(t.c, C.int(len(ops)), C.int(nsegs), C.int(nbases))
	if c == nil {
		return nil, statusError("prepare", C.UCS_ERR_NO_MEMORY)
	}
	b := &Batch{
		t:     t,
		c:     c,
		ops:   unsafe.Slice(c.ops, len(ops)),
		bases: unsafe.Slice(c.bases, nbases),
		info:  make([]opInfo, len(ops)),
		at:    make([]int, len(ops)),
	}
	segOff := unsafe.Slice(c.seg_off, max(nsegs, 1))
	segBase := unsafe.Slice(c.seg_base, max(nsegs, 1))
	iov := unsafe.Slice(c.iov, max(nsegs, 1))
	next := 0
	for j, i := range order {
		op := ops[i]
		sender := op.Peer
		if op.Send {
			sender = t.rank
		}
		var bytes int64
		for _, s := range op.Segs {
			bytes += s.Len
		}
		co := &b.ops[j]
		co.tag = C.ucp_tag_t(t.wireTag(op.Tag, sender))
		co.mask = ^C.ucp_tag_t(0)
		loose := !op.Send && op.Match != 0
		if loose {
			co.mask = C.ucp_tag_t(t.wireTag(op.Match, (1<<t.rankBits)-1))
		}
		b.at[i] = j
		co.peer = C.int32_t(op.Peer)
		co.is_send = 0
		if op.Send {
			co.is_send = 1
		}
		co.memory_type = C.int32_t(ucsMemory[op.Memory])
		co.nseg = C.int32_t(len(op.Segs))
		co.bytes = C.size_t(bytes)
		co.status = C.UCS_OK
		switch len(op.Segs) {
		case 0:
		case 1:
			co.base = C.int32_t(op.Segs[0].Base)
			co.off = C.int64_t(op.Segs[0].Off)
		default:
			co.seg_off = &segOff[next]
			co.seg_base = &segBase[next]
			co.iov = &iov[next]
			for k, s := range op.Segs {
				segOff[next+k] = C.int64_t(s.Off)
				segBase[next+k] = C.int32_t(s.Base)
				iov[next+k].length = C.size_t(s.Len)
			}
			next += len(op.Segs)
		}
		b.info[j] = opInfo{peer: op.Peer, tag: op.Tag, send: op.Send, loose: loose, bytes: bytes}
	}
	t.batches[b] = struct{}{}
	return b, nil
}

func (t *Transport) checkOp(op transport.Op) error {
	switch {
	case op.Peer < 0 || op.Peer >= t.size:
		return fmt.Errorf("peer %d is not a rank of a group of %d", op.Peer, t.size)
	case op.Peer == t.rank:
		return fmt.Errorf("peer %d is this rank", op.Peer)
	case t.rankBits > 0 && (op.Tag|op.Match)>>(64-t.rankBits) != 0:
		return fmt.Errorf("tag %#x (match %#x) does not fit in %d bits", op.Tag, op.Match, 64-t.rankBits)
	case !t.Moves(op.Memory):
		return fmt.Errorf("%w: UCX %s moves %s memory only, not %v (use a UCX built with CUDA support: HPC-X, or configured --with-cuda)",
			ErrMemoryType, Version(), strings.Join(t.MemoryTypes(), ", "), op.Memory)
	}
	var total int64
	for k, s := range op.Segs {
		if s.Base < 0 || s.Off < 0 || s.Len < 0 {
			return fmt.Errorf("segment %d has a negative base, offset or length", k)
		}
		total += s.Len
		if total < 0 {
			return fmt.Errorf("segments overflow")
		}
	}
	return nil
}

// wireTag puts the sender's rank in the top bits of tag.
func (t *Transport) wireTag(tag uint64, sender int) uint64 {
	if t.rankBits == 0 {
		return tag
	}
	return tag | uint64(sender)<<(64-t.rankBits)
}

// Post starts every operation, receives first, with segment addresses
// bases[seg.Base]+seg.Off and tagOr OR'ed into every tag (the bits a caller
// varies per post, such as a call's number). The memory must stay valid
// until Wait returns. Operations that cannot start (for example because
// their peer has failed) are reported by Wait.
func (b *Batch) Post(bases []uintptr, tagOr uint64) error {
	t := b.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if b.c == nil {
		return ErrClosed
	}
	if !t.connected {
		return errNotConnected
	}
	if b.posted {
		return errAlreadyPosted
	}
	if b.c.zombie != 0 {
		return errZombie
	}
	if len(bases) < len(b.bases) {
		return fmt.Errorf("ucx: post: %d bases for a batch that uses %d", len(bases), len(b.bases))
	}
	if t.rankBits > 0 && tagOr>>(64-t.rankBits) != 0 {
		return fmt.Errorf("ucx: post: tag bits %#x do not fit in %d bits", tagOr, 64-t.rankBits)
	}
	for i := range b.bases {
		b.bases[i] = C.uintptr_t(bases[i])
	}
	b.c.tag_or = C.ucp_tag_t(tagOr)
	if C.hux_batch_post(b.c) != 0 {
		return ErrAborted
	}
	b.posted = true
	return nil
}

// Wait is WaitFor with the time left until deadline (a zero deadline waits
// without limit).
func (b *Batch) Wait(deadline time.Time) error {
	if deadline.IsZero() {
		return b.WaitFor(-1)
	}
	return b.WaitFor(max(time.Until(deadline), 0))
}

// WaitFor progresses until every posted operation has completed or timeout
// has passed (a negative timeout waits without limit; the time starts a few
// microseconds into the wait, see hux_batch_wait). It returns nil
// only if every operation succeeded and every receive got exactly its
// length; otherwise a *WaitError naming each failed or pending operation,
// matching ErrTimeout, ErrPeerFailed or ErrMessageLength as they apply. After
// a deadline, receives are cancelled and endpoints with sends still pending
// are force-closed, so the caller's memory is free again when Wait returns;
// the transport should then be considered broken.
func (b *Batch) WaitFor(timeout time.Duration) error {
	t := b.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if b.c == nil {
		return ErrClosed
	}
	if !b.posted {
		return errNotPosted
	}
	if C.hux_batch_wait(b.c, C.int64_t(timeout)) == C.HUX_WAIT_SIGINT {
		// The wait aborted the transport: tell the peers now, before the
		// caller (whose Ctrl-C this was) may leave without a destroy.
		C.hux_say_goodbye(t.c, C.int64_t(abortGrace))
	}
	return b.result()
}

// Test progresses without blocking and reports whether the posted
// operations have all completed; when they have, err is what Wait would
// have returned and the batch may be posted again. A batch not posted is
// an error.
func (b *Batch) Test() (done bool, err error) {
	t := b.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if b.c == nil {
		return false, ErrClosed
	}
	if !b.posted {
		return false, errNotPosted
	}
	if C.hux_batch_test(b.c) == 0 {
		return false, nil
	}
	return true, b.result()
}

// result ends a post whose operations have all finished. A batch whose
// operations all succeeded still fails if a peer of it has said it aborted
// (hux_batch_goodbyes): what came from that peer belongs to an exchange it
// abandoned.
func (b *Batch) result() error {
	b.posted = false
	for i := range b.ops {
		op := &b.ops[i]
		if op.status != C.UCS_OK || (op.is_send == 0 && !b.info[i].loose && op.received != op.bytes) {
			return b.failure()
		}
	}
	if r := int(b.c.aborted_peer); r >= 0 {
		return &PeerError{Rank: r, Status: StatusPeerAborted, Cause: int(b.t.peer(r).cause)}
	}
	return nil
}

// failure describes every operation of the last post that did not succeed.
func (b *Batch) failure() error {
	werr := &WaitError{Total: len(b.ops)}
	for i := range b.ops {
		op := &b.ops[i]
		info := b.info[i]
		var err error
		switch st := Status(op.status); {
		case st == StatusOK && op.is_send == 0 && !info.loose && op.received != op.bytes:
			err = &LengthError{Expected: info.bytes, Got: int64(op.received)}
		case st == StatusOK:
			continue
		case op.why == C.HUX_WHY_DEADLINE:
			err = ErrTimeout
		case op.why == C.HUX_WHY_ABORT:
			err = ErrAborted
		case op.why == C.HUX_WHY_SIGINT:
			err = ErrInterrupted
		case op.why == C.HUX_WHY_PEER:
			err = b.t.peerError(info.peer)
		case st == StatusMessageTruncated:
			err = &LengthError{Expected: info.bytes, Got: int64(op.received)}
		case st.peerFailure():
			err = &PeerError{Rank: info.peer, Status: st, Cause: -1}
		default:
			fn := "ucp_tag_recv_nbx"
			if info.send {
				fn = "ucp_tag_send_nbx"
			}
			err = &StatusError{Func: fn, Status: st}
		}
		werr.Ops = append(werr.Ops, &OpError{
			Peer: info.peer, Tag: info.tag, Send: info.send, Bytes: info.bytes, Err: err,
		})
	}
	return werr
}

// Received is what receive i (in Prepare's order) of the last completed
// post got: the sender's tag (its caller's bits, without the rank) and the
// sender's length, which a loose receive may have truncated. Call it only
// after a Wait or Test that returned done without an error.
func (b *Batch) Received(i int) (tag uint64, n int64) {
	if b.c == nil || i < 0 || i >= len(b.at) {
		return 0, -1
	}
	op := &b.ops[b.at[i]]
	tag = uint64(op.info.sender_tag)
	if b.t.rankBits > 0 {
		tag &= 1<<(64-b.t.rankBits) - 1
	}
	return tag, int64(op.received)
}

// Close releases the batch. A batch still posted is aborted first, as after
// a deadline. Close is safe to call more than once.
func (b *Batch) Close() error {
	t := b.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if b.c == nil {
		return nil
	}
	b.destroy()
	return nil
}

// destroy frees the batch's C memory; t.mu must be held.
func (b *Batch) destroy() {
	C.hux_batch_destroy(b.c)
	delete(b.t.batches, b)
	b.c, b.ops, b.bases = nil, nil, nil
	b.posted = false
}
