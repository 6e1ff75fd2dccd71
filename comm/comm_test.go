package comm

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
	"github.com/halo-cp/halo/ucx"
)

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Two ranks in one process, bootstrapped through the embedded rendezvous,
// over real UCX: the whole assembly the C ABI and halod stand on.
func TestRendezvousAndExchange(t *testing.T) {
	addr := freeAddr(t)
	const W = 2
	errs := halotest.Ranks(W, func(r int) error {
		c, err := New(Config{Rank: r, Size: W, Rendezvous: addr, Job: "comm-test", Timeout: 10 * time.Second, BootstrapTimeout: 20 * time.Second})
		if err != nil {
			return err
		}
		defer c.Close()
		p, err := c.NewPlan(halo.Spec{DType: halo.Float64, Shape: []int64{3}, Dim: 0, Left: 1, Right: 1})
		if err != nil {
			return err
		}
		defer p.Close()
		buf, err := c.t.Alloc(8 * 8)
		if err != nil {
			return err
		}
		defer buf.Free()
		v := unsafe.Slice((*float64)(unsafe.Pointer(unsafe.SliceData(buf.Bytes()))), 8)
		x, out := v[:3], v[3:8]
		for i := range x {
			x[i] = float64(10*r + i)
		}
		if err := p.Do(halo.CallForward, true, unsafe.Pointer(&x[0]), unsafe.Pointer(&out[0]), nil); err != nil {
			return err
		}
		want := []float64{0, 0, 1, 2, 10}
		if r == 1 {
			want = []float64{2, 10, 11, 12, 0}
		}
		if fmt.Sprint(out) != fmt.Sprint(want) {
			return fmt.Errorf("rank %d: out %v, want %v", r, out, want)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	t.Setenv("HALO_TIMEOUT_MS", "")
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Rank: 0, Size: 0}, "world size 0 is out of range"},
		{Config{Rank: 3, Size: 2}, "rank 3 is out of range for world size 2"},
		{Config{Rank: 0, Size: 2, Bootstrap: 9}, "unknown bootstrap 9"},
		{Config{Rank: 0, Size: 2, Rendezvous: "nohost"}, "want host:port"},
		{Config{Rank: 0, Size: 2, Rendezvous: "10.1.2.3:5"}, "token is required"},
		{Config{Rank: 0, Size: 1, Timeout: -time.Second}, "negative"},
	} {
		_, err := New(tc.cfg)
		if !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: got %v, want %q", tc.cfg, err, tc.want)
		}
	}
	t.Setenv("HALO_TIMEOUT_MS", "soon")
	if _, err := New(Config{Rank: 0, Size: 1}); err == nil || !strings.Contains(err.Error(), `HALO_TIMEOUT_MS="soon"`) {
		t.Errorf("bad env: %v", err)
	}
}

func TestMissingRankFailsRendezvous(t *testing.T) {
	addr := freeAddr(t)
	start := time.Now()
	_, err := New(Config{Rank: 0, Size: 2, Rendezvous: addr, Job: "lonely", BootstrapTimeout: 1500 * time.Millisecond})
	if !errors.Is(err, halo.ErrRendezvous) || !strings.Contains(err.Error(), "1") {
		t.Fatalf("got %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("took %v", d)
	}
	t.Log(err)
}

// Errors from the UCX binding reach callers in halo's classes, with the
// binding's own error still inside.
func TestUCXErrorsAreClassed(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want error
	}{
		{&ucx.StatusError{Func: "wait", Status: ucx.StatusTimedOut}, halo.ErrTimeout},
		{&ucx.WaitError{Ops: []*ucx.OpError{{Peer: 1, Err: ucx.ErrTimeout}}, Total: 2}, halo.ErrTimeout},
		{&ucx.PeerError{Rank: 2, Status: ucx.StatusConnectionReset}, halo.ErrPeerFailed},
		{&ucx.StatusError{Func: "ep", Status: ucx.StatusUnreachable}, halo.ErrPeerFailed},
		{ucx.ErrClosed, halo.ErrClosed},
		{&ucx.WaitError{Ops: []*ucx.OpError{{Peer: 1, Err: ucx.ErrAborted}}, Total: 1}, halo.ErrFailed},
		{&ucx.LengthError{Expected: 8, Got: 4}, halo.ErrTransport},
		{&ucx.StatusError{Func: "open", Status: ucx.StatusNoMemory}, halo.ErrTransport},
	} {
		got := classify(tc.err)
		if !errors.Is(got, tc.want) || !errors.Is(got, tc.err) || got.Error() != tc.err.Error() {
			t.Errorf("classify(%v) = %v: want class %v, the original inside, the same message", tc.err, got, tc.want)
		}
		for _, other := range halo.Classes {
			if other != tc.want && errors.Is(got, other) {
				t.Errorf("classify(%v) is also %v", tc.err, other)
			}
		}
	}
	if classify(nil) != nil {
		t.Error("classify(nil) is not nil")
	}
}
