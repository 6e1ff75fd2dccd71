package halotest

import (
	"fmt"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/transport"
)

// MemHub connects the ranks of an in-process group: the transport the
// algorithm's tests run on, with real tag matching, length checks, deadlines
// and halo's error classes, and no UCX. Sends are eager (copied at Post).
type MemHub struct {
	mu      sync.Mutex
	size    int
	boxes   [][][]memMsg  // per receiver, per sender, in the order sent
	changed chan struct{} // closed and replaced on every delivery
	dead    []bool
	cuda    []bool                 // ranks whose transport says it moves CUDA memory
	noAlloc map[int]func(int) bool // per rank: the sizes its Alloc refuses
}

type memMsg struct {
	tag uint64
	b   []byte
}

// NewMemHub makes a hub for size ranks.
func NewMemHub(size int) *MemHub {
	h := &MemHub{size: size, boxes: make([][][]memMsg, size), changed: make(chan struct{}), dead: make([]bool, size), cuda: make([]bool, size)}
	for i := range h.boxes {
		h.boxes[i] = make([][]memMsg, size)
	}
	return h
}

// Transport returns rank's end of the hub.
func (h *MemHub) Transport(rank int) transport.Transport { return &memTransport{h: h, rank: rank} }

// MovesCUDA makes the ranks' transports say that they move CUDA memory, as
// UCX built with CUDA does; the hub copies the bytes like any others, so
// tests run bytes-only plans on host memory.
func (h *MemHub) MovesCUDA(ranks ...int) {
	for _, r := range ranks {
		h.cuda[r] = true
	}
}

// FailAlloc makes rank's Alloc refuse the sizes refuse says, as a
// registration or an allocation that cannot be made. Set it before use.
func (h *MemHub) FailAlloc(rank int, refuse func(n int) bool) {
	if h.noAlloc == nil {
		h.noAlloc = map[int]func(int) bool{}
	}
	h.noAlloc[rank] = refuse
}

// Kill makes rank's peers see it as failed, as UCX reports a dead endpoint.
func (h *MemHub) Kill(rank int) {
	h.mu.Lock()
	h.dead[rank] = true
	close(h.changed)
	h.changed = make(chan struct{})
	h.mu.Unlock()
}

type memTransport struct {
	h    *MemHub
	rank int
}

func (t *memTransport) Rank() int { return t.rank }
func (t *memTransport) Size() int { return t.h.size }

func (t *memTransport) Moves(m transport.Memory) bool {
	return m == transport.Host || (m == transport.CUDA && t.h.cuda[t.rank])
}

func (t *memTransport) Prepare(ops []transport.Op) (transport.Batch, error) {
	for _, op := range ops {
		if op.Peer < 0 || op.Peer >= t.h.size || op.Peer == t.rank {
			return nil, fmt.Errorf("%w: rank %d: bad peer %d", halo.ErrInvalid, t.rank, op.Peer)
		}
	}
	return &memBatch{t: t, ops: append([]transport.Op(nil), ops...)}, nil
}

func (t *memTransport) Alloc(n int) (transport.Buffer, error) {
	if refuse := t.h.noAlloc[t.rank]; refuse != nil && refuse(n) {
		return nil, fmt.Errorf("%w: rank %d: cannot allocate %d bytes (a test's refusal)", halo.ErrTransport, t.rank, n)
	}
	b := make([]byte, max(n, 1))
	return &memBuffer{b: b[:n:n], keep: b}, nil
}

type memBuffer struct{ b, keep []byte }

func (b *memBuffer) Addr() uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b.keep))) }
func (b *memBuffer) Bytes() []byte { return b.b }
func (b *memBuffer) Free() error   { return nil }

type memBatch struct {
	t      *memTransport
	ops    []transport.Op
	bases  []uintptr
	tagOr  uint64
	posted bool
	done   []bool   // per op, while a post is being received
	got    []memMsg // per op: what a receive took (its tag and full length)
}

// at turns an address the test owns into a pointer without a uintptr
// conversion vet would flag: the memory is kept alive by the test.
func at(base uintptr, off int64) unsafe.Pointer {
	return unsafe.Add(*(*unsafe.Pointer)(unsafe.Pointer(&base)), off)
}

func (b *memBatch) Post(bases []uintptr, tagOr uint64) error {
	h := b.t.h
	b.bases = append(b.bases[:0], bases...)
	b.tagOr = tagOr
	b.done = nil
	b.got = make([]memMsg, len(b.ops))
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, op := range b.ops {
		if !op.Send {
			continue
		}
		var msg []byte
		for _, s := range op.Segs {
			msg = append(msg, unsafe.Slice((*byte)(at(bases[s.Base], s.Off)), s.Len)...)
		}
		box := &h.boxes[op.Peer][b.t.rank]
		*box = append(*box, memMsg{op.Tag | tagOr, msg})
	}
	close(h.changed)
	h.changed = make(chan struct{})
	b.posted = true
	return nil
}

func (b *memBatch) Wait(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ch, pending, err := b.poll()
		if err != nil || len(pending) == 0 {
			return err
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			return fmt.Errorf("%w waiting for: %s", halo.ErrTimeout, strings.Join(pending, ", "))
		}
		select {
		case <-ch:
		case <-time.After(wait):
		}
	}
}

func (b *memBatch) Test() (bool, error) {
	_, pending, err := b.poll()
	return err != nil || len(pending) == 0, err
}

// poll takes every message that has arrived for a pending receive; it
// returns the receives still pending, and a channel closed at the next
// delivery.
func (b *memBatch) poll() (<-chan struct{}, []string, error) {
	h := b.t.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if b.done == nil {
		b.done = make([]bool, len(b.ops))
	}
	var pending []string
	for i, op := range b.ops {
		if b.done[i] || op.Send {
			b.done[i] = true
			continue
		}
		box := &h.boxes[b.t.rank][op.Peer]
		want, match := op.Tag|b.tagOr, ^uint64(0)
		if op.Match != 0 {
			match = op.Match
		}
		idx := -1
		for j, m := range *box {
			if m.tag&match == want&match {
				idx = j
				break
			}
		}
		if idx < 0 {
			if h.dead[op.Peer] {
				b.done = nil
				return nil, nil, fmt.Errorf("%w: recv from rank %d (tag %#x)", halo.ErrPeerFailed, op.Peer, op.Tag)
			}
			pending = append(pending, fmt.Sprintf("recv from rank %d (tag %#x)", op.Peer, op.Tag))
			continue
		}
		msg := (*box)[idx].b
		b.got[i] = (*box)[idx]
		*box = append((*box)[:idx:idx], (*box)[idx+1:]...)
		b.done[i] = true
		if op.Match != 0 {
			msg = msg[:min(int64(len(msg)), op.Bytes())] // loose: any length, cut to fit
		} else if want := op.Bytes(); int64(len(msg)) != want {
			b.done = nil
			return nil, nil, fmt.Errorf("%w: recv from rank %d (tag %#x): message length %d, expected %d", halo.ErrTransport, op.Peer, op.Tag, len(msg), want)
		}
		for _, s := range op.Segs {
			n := min(int64(len(msg)), s.Len)
			copy(unsafe.Slice((*byte)(at(b.bases[s.Base], s.Off)), n), msg[:n])
			msg = msg[n:]
		}
	}
	if len(pending) == 0 {
		b.done = nil // the next Post starts afresh
	}
	return h.changed, pending, nil
}

func (b *memBatch) Received(i int) (uint64, int64) {
	if i < 0 || i >= len(b.got) {
		return 0, -1
	}
	return b.got[i].tag, int64(len(b.got[i].b))
}

func (b *memBatch) Close() error { return nil }
