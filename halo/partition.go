package halo

// partition is how the global sequence is split among ranks along dim:
// rank r owns global positions [off[r], off[r]+n[r]).
type partition struct {
	off, n []int64
	total  int64
}

func newPartition(lengths []int64) partition {
	p := partition{off: make([]int64, len(lengths)), n: append([]int64(nil), lengths...)}
	for r, n := range lengths {
		p.off[r] = p.total
		p.total += n
	}
	return p
}

// Halo sides. A message always fills one side of its receiver's halo.
const (
	sideLeft  = 0
	sideRight = 1
)

// message is one slab that travels from rank src to rank dst in the
// forward pass: global positions [lo, hi), filling side of dst's halo.
type message struct {
	src, dst int
	side     int
	lo, hi   int64
}

// window is the global range of rank r's halo on one side.
func (p partition) window(r, side int, left, right int64) (lo, hi int64) {
	if side == sideLeft {
		return p.off[r] - left, p.off[r]
	}
	end := p.off[r] + p.n[r]
	return end, end + right
}

// incoming lists the messages rank r receives in the forward pass: left side
// first (owners in increasing rank order), then right side.
func (p partition) incoming(r int, left, right int64) []message {
	var ms []message
	for side := sideLeft; side <= sideRight; side++ {
		lo, hi := p.window(r, side, left, right)
		for q := range p.n {
			a, b := max(lo, p.off[q]), min(hi, p.off[q]+p.n[q])
			if a < b && q != r {
				ms = append(ms, message{src: q, dst: r, side: side, lo: a, hi: b})
			}
		}
	}
	return ms
}

// outgoing lists the messages rank r sends in the forward pass, in the order
// their gradients are added back in the backward pass: first to the ranks on
// the right that use r's slices as left halo (nearest first), then to the
// ranks on the left that use them as right halo (nearest first). For one hop
// this is the reference's order: right neighbour's gradient, then left's.
func (p partition) outgoing(r int, left, right int64) []message {
	var ms []message
	lo, hi := p.off[r], p.off[r]+p.n[r]
	add := func(s, side int) {
		wlo, whi := p.window(s, side, left, right)
		if a, b := max(lo, wlo), min(hi, whi); a < b {
			ms = append(ms, message{src: r, dst: s, side: side, lo: a, hi: b})
		}
	}
	for s := r + 1; s < len(p.n); s++ {
		add(s, sideLeft)
	}
	for s := r - 1; s >= 0; s-- {
		add(s, sideRight)
	}
	return ms
}

// padding returns how many slices of rank r's halo on each side lie outside
// the global sequence (zeros under zero padding).
func (p partition) padding(r int, left, right int64) (padLeft, padRight int64) {
	padLeft = min(left, max(0, left-p.off[r]))
	end := p.off[r] + p.n[r]
	padRight = min(right, max(0, end+right-p.total))
	return
}
