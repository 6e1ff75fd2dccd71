package halo

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"

	"github.com/halo-cp/halo/halo/transport"
)

// The agreement at plan creation: every rank's record of its layout, the
// exchange of the records, and the mismatch report identical on every rank.

// Plan metadata record, fixed size so every receive knows its length.
const (
	recordMagic   = 0x4f4c4148 // "HALO"
	recordVersion = 2
	recordSize    = 128
)

type record struct {
	plan        uint32
	layouts     int32 // how many layouts the plan has
	layout      int32 // which of them this is
	dtype       DType
	ndim, dim   int32
	padding     Padding
	left, right int64
	shape       [MaxDims]int64
	memory      MemoryType // at byte 112, zero (host) in records of halo 0.2
	cannotMove  bool       // at byte 116: this rank's transport cannot move memory
	call        int32      // at byte 120: what the rank was doing (callCreate, ...)
}

// What a rank was doing when it agreed: the direction, not the form (ranks
// may run padded and halos-only calls of one layout together).
const (
	callCreate   = 0
	callForward  = 1
	callBackward = 2
)

var callNames = map[int32]string{callCreate: "creating the plan", callForward: "forward", callBackward: "backward"}

func (p *Plan) record(k int) record {
	s := &p.specs[k]
	r := record{plan: p.id, layouts: int32(len(p.specs)), layout: int32(k), dtype: s.DType, ndim: int32(len(s.Shape)),
		dim: int32(s.Dim), padding: s.Padding, left: s.Left, right: s.Right, memory: s.Memory,
		cannotMove: !transport.Moves(p.g.t, s.Memory)}
	copy(r.shape[:], s.Shape)
	return r
}

func (r *record) encode(b []byte) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], recordMagic)
	le.PutUint16(b[4:], recordVersion)
	le.PutUint32(b[8:], r.plan)
	le.PutUint32(b[12:], uint32(r.dtype))
	le.PutUint32(b[16:], uint32(r.ndim))
	le.PutUint32(b[20:], uint32(r.dim))
	le.PutUint32(b[24:], uint32(r.padding))
	le.PutUint16(b[28:], uint16(r.layouts))
	le.PutUint16(b[30:], uint16(r.layout))
	le.PutUint64(b[32:], uint64(r.left))
	le.PutUint64(b[40:], uint64(r.right))
	for i, n := range r.shape {
		le.PutUint64(b[48+8*i:], uint64(n))
	}
	le.PutUint32(b[112:], uint32(r.memory))
	if r.cannotMove {
		b[116] = 1
	}
	le.PutUint32(b[120:], uint32(r.call))
}

func decodeRecord(b []byte) (record, error) {
	le := binary.LittleEndian
	if le.Uint32(b[0:]) != recordMagic || le.Uint16(b[4:]) != recordVersion {
		return record{}, fmt.Errorf("not a halo plan record of version %d (another program or halo version on the wire?)", recordVersion)
	}
	r := record{plan: le.Uint32(b[8:]), dtype: DType(le.Uint32(b[12:])), ndim: int32(le.Uint32(b[16:])),
		dim: int32(le.Uint32(b[20:])), padding: Padding(le.Uint32(b[24:])),
		layouts: int32(le.Uint16(b[28:])), layout: int32(le.Uint16(b[30:])),
		left: int64(le.Uint64(b[32:])), right: int64(le.Uint64(b[40:]))}
	for i := range r.shape {
		r.shape[i] = int64(le.Uint64(b[48+8*i:]))
	}
	r.memory = MemoryType(le.Uint32(b[112:]))
	r.cannotMove = b[116] != 0
	r.call = int32(le.Uint32(b[120:]))
	if r.ndim < 1 || r.ndim > MaxDims || r.dim < 0 || r.dim >= r.ndim || r.layouts < 1 || r.layouts > MaxLayouts {
		return record{}, fmt.Errorf("corrupt plan record (ndim %d, dim %d, layouts %d)", r.ndim, r.dim, r.layouts)
	}
	return r, nil
}

// agree runs the agreement of call seq: every rank sends every other its
// records, each finds the same instance from all of them (or the same
// disagreement), makes it if it has not kept it, and the ranks exchange
// whether they could: the result is the same on every rank, and every
// message sent is received, so the group stays usable whatever the result
// (unless the wire itself failed).
//
// verify (nil for a creation) checks the caller's tensors against the
// instance found: a failure there is one more local result the ranks share.
func (p *Plan) agree(seq uint64, call int32, verify func(*instance) error) (*instance, error) {
	g, W, me, K := p.g, p.g.Size(), p.g.Rank(), len(p.specs)
	const msg = MaxLayouts * recordSize
	mine := make([]byte, msg)
	for k := range p.specs {
		r := p.record(k)
		r.call = call
		r.encode(mine[k*recordSize:])
	}
	got, err := g.round(seq, phaseSetup, mine)
	if err != nil {
		return nil, fmt.Errorf("rank %d: agreeing on plan %d (every rank must make the same collective calls in the same order): %w", me, p.id, err)
	}
	recs := make([][]record, W)
	for q := 0; q < W; q++ {
		theirs := got[q]
		r, err := decodeRecord(theirs)
		for k := 1; err == nil && k < int(r.layouts); k++ {
			var rk record
			if rk, err = decodeRecord(theirs[k*recordSize:]); err == nil {
				recs[q] = append(recs[q], rk)
			}
		}
		if err != nil {
			return nil, g.fail(fmt.Errorf("%w: rank %d: plan record from rank %d: %v", ErrTransport, me, q, err))
		}
		recs[q] = append([]record{r}, recs[q]...)
	}
	if msg := disagreement(recs); msg != "" {
		return nil, fmt.Errorf("%w on plan %d (seen by rank %d): %s", ErrMismatch, p.id, me, msg)
	}
	var unable []int
	for q := range recs {
		if recs[q][0].cannotMove {
			unable = append(unable, q)
		}
	}
	if len(unable) > 0 {
		// Decided from the records, so every rank fails alike.
		return nil, fmt.Errorf("%w: plan %d (seen by rank %d): the transport of %s cannot move %v memory (its UCX was built without it): "+
			"use a UCX built with CUDA support (HPC-X, or UCX configured --with-cuda) on every rank, or stage the slabs through host memory "+
			"with a host plan (halocp does so itself)", ErrInvalid, p.id, me, rankList(unable), recs[unable[0]][0].memory)
	}
	lengths := make([][]int64, K)
	for k := range lengths {
		lengths[k] = make([]int64, W)
		for q := range recs {
			r := recs[q][k]
			lengths[k][q] = r.shape[r.dim]
		}
	}
	ident := g.identOf(agreementHash(recs))
	in, made := p.find(ident), false
	var local error
	if in == nil {
		in, local = p.newInstance(ident, lengths)
		made = local == nil
	}
	if local == nil && verify != nil {
		local = verify(in)
	}
	if err := g.outcome(seq, p.id, local); err != nil {
		if made {
			in.close()
		} else if in != nil && local == nil {
			p.use(in) // agreed and kept; only this call failed
		}
		return nil, err
	}
	p.use(in)
	return in, nil
}

// round sends mine to every other rank under call seq's tag of phase and
// returns every rank's message (got[me] is mine). The messages are all as
// long as mine.
func (g *Group) round(seq uint64, phase int, mine []byte) ([][]byte, error) {
	W, me, n := g.Size(), g.Rank(), len(mine)
	got := make([][]byte, W)
	got[me] = mine
	if W == 1 {
		return got, nil
	}
	buf, err := g.t.Alloc(n * (W + 1))
	if err != nil {
		return nil, err
	}
	defer buf.Free()
	copy(buf.Bytes()[W*n:], mine)
	var ops []transport.Op
	for _, send := range []bool{false, true} {
		for q := 0; q < W; q++ {
			if q == me {
				continue
			}
			off := int64(q * n)
			if send {
				off = int64(W * n)
			}
			ops = append(ops, transport.Op{Peer: q, Tag: g.tag(identNone, phase), Send: send,
				Segs: []transport.Segment{{Off: off, Len: int64(n)}}})
		}
	}
	b, err := g.t.Prepare(ops)
	if err != nil {
		return nil, err
	}
	defer b.Close()
	if err := b.Post([]uintptr{buf.Addr()}, seq); err != nil {
		return nil, g.fail(err)
	}
	if err := b.Wait(g.opts.Timeout); err != nil {
		return nil, g.fail(err)
	}
	for q := 0; q < W; q++ {
		if q != me {
			got[q] = append([]byte(nil), buf.Bytes()[q*n:(q+1)*n]...)
		}
	}
	return got, nil
}

// An outcome message: the error class (its index in Classes, plus one; 0
// for success) and the start of the message.
const outcomeSize = 256

// outcome tells every rank whether this rank made its part of plan id (local
// is its error) and returns the same result on every rank: nil if all
// could, else the class of the first rank that could not, naming every such
// rank and what the first said.
func (g *Group) outcome(seq uint64, id uint32, local error) error {
	mine := make([]byte, outcomeSize)
	if local != nil {
		code := len(Classes) // ErrInternal unless classed
		for i, c := range Classes {
			if errors.Is(local, c) {
				code = i + 1
				break
			}
		}
		binary.LittleEndian.PutUint32(mine, uint32(code))
		copy(mine[4:], local.Error())
	}
	got, err := g.round(seq, phaseOutcome, mine)
	if err != nil {
		return fmt.Errorf("rank %d: agreeing on plan %d: %w", g.Rank(), id, err)
	}
	var failed []int
	first := -1
	for q, m := range got {
		if binary.LittleEndian.Uint32(m) != 0 {
			failed = append(failed, q)
			if first < 0 {
				first = q
			}
		}
	}
	if first < 0 {
		return nil
	}
	code := int(binary.LittleEndian.Uint32(got[first]))
	class := ErrInternal
	if code >= 1 && code <= len(Classes) {
		class = Classes[code-1]
	}
	why := strings.TrimRight(string(got[first][4:]), "\x00")
	return Classify(class, fmt.Errorf("rank %d: plan %d: %s failed after the ranks agreed, so no rank went on (rank %d: %s)",
		g.Rank(), id, rankList(failed), first, why))
}

// agreementHash digests what makes an instance: every rank's layouts as
// agreed (their lengths included). What may differ between ranks (strides,
// padded or halos-only calls, plan numbers) is left out.
func agreementHash(recs [][]record) uint64 {
	h := fnv.New64a()
	var b [8]byte
	put := func(v int64) {
		binary.LittleEndian.PutUint64(b[:], uint64(v))
		h.Write(b[:])
	}
	for _, rs := range recs {
		put(int64(len(rs)))
		for _, r := range rs {
			for _, v := range []int64{int64(r.dtype), int64(r.ndim), int64(r.dim), int64(r.padding), r.left, r.right, int64(r.memory)} {
				put(v)
			}
			for _, n := range r.shape[:r.ndim] {
				put(n)
			}
		}
	}
	return h.Sum64()
}

// disagreement describes every field on which the records differ, naming the
// ranks, or returns "". recs[q] are rank q's records, one per layout.
func disagreement(recs [][]record) string {
	var parts []string
	field := func(name string, val func(rs []record) string) {
		groups := map[string][]int{}
		var order []string
		for q, rs := range recs {
			v := val(rs)
			if _, ok := groups[v]; !ok {
				order = append(order, v)
			}
			groups[v] = append(groups[v], q)
		}
		if len(order) < 2 {
			return
		}
		var vs []string
		for _, v := range order {
			vs = append(vs, fmt.Sprintf("%s on %s", v, rankList(groups[v])))
		}
		parts = append(parts, name+": "+strings.Join(vs, ", "))
	}
	field("call", func(rs []record) string { return callNames[rs[0].call] })
	field("number of layouts", func(rs []record) string { return fmt.Sprint(len(rs)) })
	if len(parts) > 0 {
		return strings.Join(parts, "; ")
	}
	n := len(recs[0])
	for k := 0; k < n; k++ {
		at := func(f func(r record) string) func(rs []record) string {
			return func(rs []record) string { return f(rs[k]) }
		}
		pre := layoutName(k, n)
		before := len(parts)
		field(pre+"dtype", at(func(r record) string { return r.dtype.String() }))
		field(pre+"ndim", at(func(r record) string { return fmt.Sprint(r.ndim) }))
		field(pre+"dim", at(func(r record) string { return fmt.Sprint(r.dim) }))
		field(pre+"left halo", at(func(r record) string { return fmt.Sprint(r.left) }))
		field(pre+"right halo", at(func(r record) string { return fmt.Sprint(r.right) }))
		field(pre+"padding", at(func(r record) string { return fmt.Sprint(r.padding) }))
		field(pre+"memory type", at(func(r record) string { return r.memory.String() }))
		if len(parts) == before { // same ndim and dim: compare the other dims
			r0 := recs[0][k]
			for i := 0; i < int(r0.ndim); i++ {
				if i != int(r0.dim) {
					field(fmt.Sprintf("%sshape[%d]", pre, i), at(func(r record) string { return fmt.Sprint(r.shape[i]) }))
				}
			}
		}
	}
	return strings.Join(parts, "; ")
}

// rankList prints ranks compactly: "rank 3", "ranks 0-2, 5".
func rankList(rs []int) string {
	var s []string
	for i := 0; i < len(rs); {
		j := i
		for j+1 < len(rs) && rs[j+1] == rs[j]+1 {
			j++
		}
		if j > i {
			s = append(s, fmt.Sprintf("%d-%d", rs[i], rs[j]))
		} else {
			s = append(s, fmt.Sprint(rs[i]))
		}
		i = j + 1
	}
	if len(rs) == 1 {
		return "rank " + s[0]
	}
	return "ranks " + strings.Join(s, ", ")
}
