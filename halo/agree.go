package halo

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/halo-cp/halo/halo/transport"
)

// The agreement at plan creation: every rank's record of its layout, the
// exchange of the records, and the mismatch report identical on every rank.

// Plan metadata record, fixed size so every receive knows its length.
const (
	recordMagic   = 0x4f4c4148 // "HALO"
	recordVersion = 1
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
}

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
	if r.ndim < 1 || r.ndim > MaxDims || r.dim < 0 || r.dim >= r.ndim || r.layouts < 1 || r.layouts > MaxLayouts {
		return record{}, fmt.Errorf("corrupt plan record (ndim %d, dim %d, layouts %d)", r.ndim, r.dim, r.layouts)
	}
	return r, nil
}

// agree sends this rank's records (one per layout) to every other rank,
// receives theirs, and checks that all agree. Every rank sees every record,
// so every rank reports the same disagreement. The message has room for
// MaxLayouts records whatever the plan's count, so that ranks that disagree
// on the count still receive each other's and can say so.
func (p *Plan) agree() ([][]int64, error) {
	g, W, me, K := p.g, p.g.Size(), p.g.Rank(), len(p.specs)
	const msg = MaxLayouts * recordSize
	recs := make([][]record, W)
	recs[me] = make([]record, K)
	for k := range p.specs {
		recs[me][k] = p.record(k)
	}
	if W > 1 {
		buf, err := g.t.Alloc(msg * (W + 1))
		if err != nil {
			return nil, err
		}
		defer buf.Free()
		mine := buf.Bytes()[W*msg:]
		for k := range recs[me] {
			recs[me][k].encode(mine[k*recordSize:])
		}
		var ops []transport.Op
		for q := 0; q < W; q++ {
			if q != me {
				ops = append(ops, transport.Op{Peer: q, Tag: tag(0, phaseSetup),
					Segs: []transport.Segment{{Off: int64(q * msg), Len: msg}}})
			}
		}
		for q := 0; q < W; q++ {
			if q != me {
				ops = append(ops, transport.Op{Peer: q, Tag: tag(0, phaseSetup), Send: true,
					Segs: []transport.Segment{{Off: int64(W * msg), Len: msg}}})
			}
		}
		b, err := g.t.Prepare(ops)
		if err != nil {
			return nil, err
		}
		defer b.Close()
		if err := b.Post([]uintptr{buf.Addr()}); err != nil {
			return nil, g.fail(fmt.Errorf("rank %d: creating plan %d: %w", me, p.id, err))
		}
		if err := b.Wait(g.opts.Timeout); err != nil {
			return nil, g.fail(fmt.Errorf("rank %d: creating plan %d (every rank must create the same plans in the same order): %w", me, p.id, err))
		}
		for q := 0; q < W; q++ {
			if q == me {
				continue
			}
			theirs := buf.Bytes()[q*msg:]
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
	return lengths, nil
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
	field("plan number (plans created in a different order)", func(rs []record) string { return fmt.Sprint(rs[0].plan) })
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
