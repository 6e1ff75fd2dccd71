package comm

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// The exchange pair and its requests from Go, as halod would use them: two
// ranks over real UCX, on the host and ordered on streams of the host
// emulation of the CUDA driver, all giving the plan's own result.
func TestExchangePairAndRequests(t *testing.T) {
	onPlanRanks(t, "pair-test", func(r int, c *Comm, p *halo.Plan) error {
		x := []float64{float64(10 * r), float64(10*r + 1), float64(10*r + 2)}
		want := fmt.Sprint([]float64{0, 0, 1, 2, 10})
		if r == 1 {
			want = fmt.Sprint([]float64{2, 10, 11, 12, 0})
		}
		// Streams of their own: the emulation is one per process, and a
		// stream shared by both ranks would order one's exchange after the other's.
		for _, stream := range []uintptr{0, uintptr(0x51 + 2*r)} {
			out := make([]float64, 5)
			bufs := []unsafe.Pointer{unsafe.Pointer(&x[0]), unsafe.Pointer(&out[0])}
			if err := c.Exchange(p, halo.DirForward, bufs, stream); err != nil {
				return fmt.Errorf("rank %d: stream %#x: Exchange: %w", r, stream, err)
			}
			if fmt.Sprint(out) != want {
				return fmt.Errorf("rank %d: stream %#x: Exchange: out %v, want %s", r, stream, out, want)
			}
			clear(out)
			q, err := c.Start(p, halo.DirForward, bufs, stream)
			if err != nil {
				return fmt.Errorf("rank %d: stream %#x: Start: %w", r, stream, err)
			}
			if stream == 0 && !c.Owned(p, halo.DirForward) {
				return fmt.Errorf("rank %d: a host request's exchange is not owned by it", r)
			}
			if err := q.Wait(); err != nil {
				return fmt.Errorf("rank %d: stream %#x: Wait: %w", r, stream, err)
			}
			if done, err := q.Test(); !done || err != nil {
				return fmt.Errorf("rank %d: Test after Wait: %v, %v", r, done, err)
			}
			if err := q.Free(); err != nil {
				return err
			}
			if c.Owned(p, halo.DirForward) {
				return fmt.Errorf("rank %d: the plan's forward is still owned after the request ended", r)
			}
			if fmt.Sprint(out) != want {
				return fmt.Errorf("rank %d: stream %#x: Start: out %v, want %s", r, stream, out, want)
			}
		}
		// A request of a closed communicator has ended, saying why.
		q, err := c.Start(p, halo.DirForward, []unsafe.Pointer{unsafe.Pointer(&x[0]), unsafe.Pointer(&make([]float64, 5)[0])}, uintptr(0x52+2*r))
		if err != nil {
			return err
		}
		if err := q.Wait(); err != nil {
			return err
		}
		if err := c.ClosePlan(p); err != nil {
			return err
		}
		c.EndRequests(errors.New("closed by the test"))
		if _, err := q.Test(); err == nil || err.Error() != "closed by the test" {
			return fmt.Errorf("rank %d: Test after EndRequests: %v", r, err)
		}
		return q.Free()
	})
}

// onPlanRanks runs body on two ranks in this process, each with a
// communicator over the embedded rendezvous and real UCX (streams: the host
// emulation of the CUDA driver) and a plan of 3 float64 with halos of 1.
func onPlanRanks(t *testing.T, job string, body func(r int, c *Comm, p *halo.Plan) error) {
	addr := freeAddr(t)
	const W = 2
	errs := halotest.Ranks(W, func(r int) error {
		c, err := New(Config{Rank: r, Size: W, Rendezvous: addr, Job: job, Timeout: 10 * time.Second,
			BootstrapTimeout: 20 * time.Second, CUDADriver: "host-fake"})
		if err != nil {
			return err
		}
		defer c.Close()
		p, err := c.NewPlan(halo.Spec{DType: halo.Float64, Shape: []int64{3}, Dim: 0, Left: 1, Right: 1})
		if err != nil {
			return err
		}
		return body(r, c, p)
	})
	for _, err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// A stream-ordered exchange that fails after its request was freed unread
// (as halocp frees one once a stream was told to wait for it): the next
// exchange on the host (which waits for the queued ones first, so it knows
// of the failure) reports it, once, instead of running, and the one after
// runs; a failure the caller was told of (Wait) is not reported again.
func TestFreedRequestFailureIsReported(t *testing.T) {
	onPlanRanks(t, "lost-test", func(r int, c *Comm, p *halo.Plan) error {
		x, out := make([]float64, 3), make([]float64, 5)
		good := []unsafe.Pointer{unsafe.Pointer(&x[0]), unsafe.Pointer(&out[0])}
		// Three buffers for a plan that takes two: refused by the run on
		// the proxy, before anything goes on the wire (every rank alike).
		bad := append(good, unsafe.Pointer(&out[1]))
		stream := uintptr(0x61 + 2*r)
		for _, tell := range []bool{false, true} {
			q, err := c.Start(p, halo.DirForward, bad, stream)
			if err != nil {
				return fmt.Errorf("rank %d: Start: %w", r, err)
			}
			if err := q.WaitOn(uintptr(0x62 + 2*r)); err != nil {
				return fmt.Errorf("rank %d: WaitOn: %w", r, err)
			}
			if tell {
				if err := q.Wait(); !errors.Is(err, halo.ErrInvalid) {
					return fmt.Errorf("rank %d: Wait of the bad exchange: %v", r, err)
				}
			}
			if err := q.Free(); err != nil {
				return err
			}
			err = c.Exchange(p, halo.DirForward, good, 0)
			switch {
			case tell && err != nil:
				return fmt.Errorf("rank %d: a failure its caller was told of was reported again: %v", r, err)
			case !tell && (!errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), "freed before its result was read")):
				return fmt.Errorf("rank %d: the exchange after a freed failed one: %v", r, err)
			}
			if err := c.Exchange(p, halo.DirForward, good, stream); err != nil {
				return fmt.Errorf("rank %d: the exchange after the report: %w", r, err)
			}
		}
		return nil
	})
}
