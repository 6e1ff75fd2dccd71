package halo

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

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
	during      occasion   // at byte 120: what the rank was doing
}

// occasion is what a rank was doing when it agreed: the direction, not the
// form (ranks may run padded and halos-only calls of one layout together).
// Its values are the wire's, not those of the exported Call.
type occasion int32

const (
	duringCreate   occasion = 0
	duringForward  occasion = 1
	duringBackward occasion = 2
)

var occasionNames = map[occasion]string{duringCreate: "creating the plan", duringForward: "forward", duringBackward: "backward"}

// newRecord is the record of layout k of plan p.
func newRecord(p *Plan, k int, during occasion) record {
	s := &p.specs[k]
	r := record{plan: p.id, layouts: int32(len(p.specs)), layout: int32(k), dtype: s.DType, ndim: int32(len(s.Shape)),
		dim: int32(s.Dim), padding: s.Padding, left: s.Left, right: s.Right, memory: s.Memory,
		cannotMove: !transport.Moves(p.g.t, s.Memory), during: during}
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
	le.PutUint32(b[120:], uint32(r.during))
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
	r.during = occasion(le.Uint32(b[120:]))
	if r.ndim < 1 || r.ndim > MaxDims || r.dim < 0 || r.dim >= r.ndim || r.layouts < 1 || r.layouts > MaxLayouts {
		return record{}, fmt.Errorf("corrupt plan record (ndim %d, dim %d, layouts %d)", r.ndim, r.dim, r.layouts)
	}
	return r, nil
}

// agreement is one agreement of call seq in progress: every rank sends
// every other its records, each finds the same instance from all of them (or
// the same disagreement), makes it if it has not kept it, and the ranks
// exchange whether they could: the result is the same on every rank, and
// every message sent is received, so the group stays usable whatever the
// result (unless the wire itself failed).
//
// Its two rounds are posted and tested without blocking, so a rank blocked
// in one call (its own agreement, a wait, a plan creation) still answers
// the agreements of the others in flight (Group.block): ranks may finish
// their exchanges in different orders.
type agreement struct {
	p       *Plan
	seq     uint64
	verify  func(*instance) error // nil for a creation: checks the caller's tensors against the instance found
	r       *round                // the round in flight: the records, then the results
	outcome bool                  // the records are in; r is the results' round
	in      *instance             // found or made from the records
	made    bool                  // in was made by this agreement (closed if it fails)
	local   error                 // this rank's result of making in and verifying
	moves   int                   // rounds completed, for Group.block's deadline
}

// newAgreement posts plan p's records of call seq, made during it.
func newAgreement(p *Plan, seq uint64, during occasion, verify func(*instance) error) (*agreement, error) {
	const msg = MaxLayouts * recordSize
	mine := make([]byte, msg)
	for k := range p.specs {
		r := newRecord(p, k, during)
		r.encode(mine[k*recordSize:])
	}
	a := &agreement{p: p, seq: seq, verify: verify}
	var err error
	if a.r, err = newRound(p.g, seq, phaseSetup, mine); err != nil {
		return nil, a.wireErr(err)
	}
	return a, nil
}

// wireErr says which agreement the wire failed in, and drops what it made.
func (a *agreement) wireErr(err error) error {
	p := a.p
	if !a.outcome {
		return fmt.Errorf("rank %d: agreeing on plan %d (every rank must make the same collective calls in the same order): %w", p.g.Rank(), p.id, err)
	}
	a.drop()
	return fmt.Errorf("rank %d: agreeing on plan %d: %w", p.g.Rank(), p.id, err)
}

// drop closes the instance this agreement made, which no rank will run.
func (a *agreement) drop() {
	if a.made {
		a.in.close()
		a.made = false
	}
}

// step advances the agreement without blocking; done once it has ended: in
// is the instance every rank agreed on, or err says why there is none.
func (a *agreement) step() (in *instance, done bool, err error) {
	p, g := a.p, a.p.g
	var got [][]byte
	for {
		var ok bool
		if got, ok, err = a.r.test(); err != nil {
			return nil, true, a.wireErr(err)
		}
		if !ok {
			return nil, false, nil
		}
		a.moves++
		if a.outcome {
			break
		}
		// The records are in: decide, then tell the others how it went.
		if err := a.decide(got); err != nil {
			return nil, true, err
		}
		a.outcome = true
		if a.r, err = newRound(g, a.seq, phaseOutcome, outcomeMessage(a.local)); err != nil {
			return nil, true, a.wireErr(err)
		}
	}
	a.r = nil
	if err := a.outcomeOf(got); err != nil {
		if a.made {
			a.drop()
		} else if a.in != nil && a.local == nil {
			p.use(a.in) // agreed and kept; only this call failed
		}
		return nil, true, err
	}
	in = a.in
	// Both directions of the plan may have agreed on the same layout at
	// once, each making its own: keep the first one agreed.
	if x := p.find(in.ident); x != nil && x != in {
		a.drop()
		in = x
	}
	a.made = false // the plan's now
	p.use(in)
	return in, true, nil
}

// wait blocks on the round in flight, for Group.block when nothing else
// needs this rank; step then goes on.
func (a *agreement) wait(timeout time.Duration) error {
	if a.r == nil {
		return nil
	}
	if err := a.r.wait(timeout); err != nil {
		return a.wireErr(err)
	}
	return nil
}

// close ends an agreement that will not finish (its plan is closed).
func (a *agreement) close() {
	if a.r != nil {
		a.r.close()
		a.r = nil
	}
	a.drop()
}

// decide reads every rank's records: it finds the instance they describe,
// or their disagreement (the same on every rank), and makes the instance
// if this rank has not kept it. A local failure to make or verify it is
// a.local, for the outcome round.
func (a *agreement) decide(got [][]byte) error {
	p, g := a.p, a.p.g
	W, me, K := g.Size(), g.Rank(), len(p.specs)
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
			return g.fail(fmt.Errorf("%w: rank %d: plan record from rank %d: %v", ErrTransport, me, q, err))
		}
		recs[q] = append([]record{r}, recs[q]...)
	}
	if msg := disagreement(recs); msg != "" {
		return fmt.Errorf("%w on plan %d (seen by rank %d): %s", ErrMismatch, p.id, me, msg)
	}
	var unable []int
	for q := range recs {
		if recs[q][0].cannotMove {
			unable = append(unable, q)
		}
	}
	if len(unable) > 0 {
		// Decided from the records, so every rank fails alike.
		return fmt.Errorf("%w: plan %d (seen by rank %d): the transport of %s cannot move %v memory (its UCX was built without it): "+
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
	a.in = p.find(ident)
	if a.in == nil {
		a.in, a.local = p.newInstance(ident, lengths)
		a.made = a.local == nil
	}
	if a.local == nil && a.verify != nil {
		a.local = a.verify(a.in)
	}
	return nil
}

// run takes the agreement to its end, blocking (a plan's creation).
func (a *agreement) run() (*instance, error) {
	var in *instance
	err := a.p.g.block(nil, func() (bool, error) {
		var done bool
		var err error
		in, done, err = a.step()
		return done, err
	}, a.wait, func() int { return a.moves })
	if err != nil {
		a.close() // the wire failed under another call: the round may be posted still
	}
	return in, err
}

// round is one round of an agreement: mine sent to every other rank under
// call seq's tag of phase, and every rank's received. The messages are all
// as long as mine.
type round struct {
	g    *Group
	mine []byte
	buf  transport.Buffer
	b    transport.Batch
	got  [][]byte // once done; got[me] is mine
}

var errRoundClosed = fmt.Errorf("%w: an agreement's round was used after it failed", ErrInternal)

// newRound posts mine to every other rank of g and the receives of theirs.
func newRound(g *Group, seq uint64, phase int, mine []byte) (*round, error) {
	W, me, n := g.Size(), g.Rank(), len(mine)
	r := &round{g: g, mine: mine}
	if W == 1 {
		r.got = [][]byte{mine}
		return r, nil
	}
	buf, err := g.t.Alloc(n * (W + 1))
	if err != nil {
		return nil, err
	}
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
		buf.Free()
		return nil, err
	}
	r.buf, r.b = buf, b
	if err := b.Post([]uintptr{buf.Addr()}, seq); err != nil {
		r.close()
		return nil, g.fail(err)
	}
	return r, nil
}

// test reports every rank's message once all have arrived, without blocking.
func (r *round) test() ([][]byte, bool, error) {
	if r.got != nil {
		return r.got, true, nil
	}
	if r.b == nil {
		return nil, true, errRoundClosed
	}
	done, err := r.b.Test()
	if err != nil {
		r.close()
		return nil, true, r.g.fail(err)
	}
	if done {
		r.collect()
	}
	return r.got, done, nil
}

// wait blocks until every rank's message has arrived (test then has them).
func (r *round) wait(timeout time.Duration) error {
	if r.got != nil {
		return nil
	}
	if r.b == nil {
		return errRoundClosed
	}
	if err := r.b.Wait(timeout); err != nil {
		r.close()
		return r.g.fail(err)
	}
	r.collect()
	return nil
}

func (r *round) collect() {
	W, me, n := r.g.Size(), r.g.Rank(), len(r.mine)
	r.got = make([][]byte, W)
	r.got[me] = r.mine
	for q := 0; q < W; q++ {
		if q != me {
			r.got[q] = append([]byte(nil), r.buf.Bytes()[q*n:(q+1)*n]...)
		}
	}
	r.close()
}

func (r *round) close() {
	if r.b != nil {
		r.b.Close()
		r.b = nil
	}
	if r.buf != nil {
		r.buf.Free()
		r.buf = nil
	}
}

// An outcome message: the error class (its index in Classes, plus one; 0
// for success) and the start of the message.
const outcomeSize = 256

// outcomeMessage is this rank's result of making its part of a plan (local
// is its error), for the outcome round.
func outcomeMessage(local error) []byte {
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
	return mine
}

// outcomeOf reads every rank's outcome message and returns the same result
// on every rank: nil if all could, else the class of the first rank that
// could not, naming every such rank and what the first said.
func (a *agreement) outcomeOf(got [][]byte) error {
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
		a.p.g.Rank(), a.p.id, rankList(failed), first, why))
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
	field("call", func(rs []record) string { return occasionNames[rs[0].during] })
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
