package comm

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/rendezvous"
	"github.com/halo-cp/halo/ucx"
)

// realAddress is a UCX 1.13 worker address as this library's transport
// makes it (shared memory, TCP, self), kept so that the envelope's tests
// and fuzzer need no UCX.
func realAddress(t testing.TB) []byte {
	t.Helper()
	realOnce.Do(func() {
		var h []byte
		if h, realErr = os.ReadFile("testdata/ucx-address.hex"); realErr == nil {
			realAddr, realErr = hex.DecodeString(strings.TrimSpace(string(h)))
		}
	})
	if realErr != nil {
		t.Fatal(realErr)
	}
	return realAddr
}

var (
	realOnce sync.Once
	realAddr []byte
	realErr  error
)

var testJob = jobDigest("job", "attempt")

// check2 runs the receiving side's checks as rank 0 of 2, with peer as
// rank 1's address.
func check2(t testing.TB, peer []byte) ([][]byte, error) {
	raw := realAddress(t)
	own := sealAddress(raw, nil, 0, 2, testJob)
	got, _, err := checkAddresses([][]byte{own, peer}, 0, own, testJob, func(a []byte) error { return ucx.CheckAddress(raw, a) })
	return got, err
}

func TestAddressEnvelope(t *testing.T) {
	raw := realAddress(t)
	peer := sealAddress(raw, nil, 1, 2, testJob)
	got, err := check2(t, peer)
	if err != nil || !bytes.Equal(got[1], raw) || got[0] != nil {
		t.Fatalf("a good address: %v, %x", err, got)
	}
	// Every single-byte change, every truncation and an extension are
	// refused, naming rank 1: the checksum covers every byte.
	for i := range peer {
		for _, x := range []byte{0xff, 0x01, 0x80} {
			b := bytes.Clone(peer)
			b[i] ^= x
			if _, err := check2(t, b); err == nil || !strings.Contains(err.Error(), "rank 1") {
				t.Fatalf("byte %d ^ %#x: %v", i, x, err)
			}
		}
	}
	for n := range peer {
		if _, err := check2(t, peer[:n]); err == nil {
			t.Fatalf("first %d bytes accepted", n)
		}
	}
	if _, err := check2(t, append(bytes.Clone(peer), 0)); err == nil {
		t.Fatal("a byte more accepted")
	}
	for _, c := range []struct {
		name string
		addr []byte
		want string
	}{
		{"raw UCX bytes", raw, `the address of rank 1 is not a halo address (what halo_comm_get_address returns): it does not start with "HALA"`},
		{"random", randomBytes(300, 1), "the address of rank 1 is not a halo address"},
		{"empty", nil, "shorter than the envelope"},
		{"rank 0's", sealAddress(raw, nil, 0, 2, testJob), "the address given for rank 1 was made by rank 0 of 2"},
		{"another size", sealAddress(raw, nil, 1, 3, testJob), "was made by rank 1 of 3"},
		{"another job", sealAddress(raw, nil, 1, 2, jobDigest("job", "other attempt")), "the address of rank 1 belongs to another job"},
		{"a byte-0 flip inside", sealAddress(flip(raw, 0, 0xff), nil, 1, 2, testJob), "the address of rank 1 is unusable: not a worker address of this UCX: address version 15"},
		{"a byte-51 flip inside", sealAddress(flip(raw, 51, 0xff), nil, 1, 2, testJob), "interface overhead"},
		{"truncated inside", sealAddress(raw[:100], nil, 1, 2, testJob), "runs past the end"},
	} {
		if _, err := check2(t, c.addr); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %q", c.name, err, c.want)
		}
	}
	own := sealAddress(raw, nil, 0, 2, testJob)
	if _, _, err := checkAddresses([][]byte{peer, peer}, 0, own, testJob, nil); err == nil || !strings.Contains(err.Error(), "not its own") {
		t.Errorf("own slot with another address: %v", err)
	}
}

func flip(b []byte, i int, x byte) []byte {
	b = bytes.Clone(b)
	b[i] ^= x
	return b
}

func randomBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// FuzzPeerAddress feeds the receiving side's checks rank 1's address:
// the fuzzed bytes as they are (as halo_comm_connect or the rendezvous
// could be handed them) and, sealed in a proper envelope, as UCX's part
// (as a forger who knows the format could make them). Neither may panic;
// what passes must be what ucx.CheckAddress passes. The seeds in
// testdata/fuzz/FuzzPeerAddress are what aborted rank 0 inside UCX 1.13:
// random blobs, a real address with byte 0 (the version: "Assertion
// addr_version == V2") or byte 51 (an interface overhead's sign) flipped.
func FuzzPeerAddress(f *testing.F) {
	raw := realAddress(f)
	f.Fuzz(func(t *testing.T, b []byte, seal bool) {
		peer := b
		if seal {
			peer = sealAddress(b, nil, 1, 2, testJob)
		}
		got, err := check2(t, peer)
		if err != nil {
			if !strings.Contains(err.Error(), "rank 1") {
				t.Fatalf("error does not name rank 1: %v", err)
			}
			return
		}
		if err := ucx.CheckAddress(raw, got[1]); err != nil {
			t.Fatalf("accepted what UCX's check refuses: %v", err)
		}
		if !seal {
			e, err := openAddress(b)
			if err != nil || e.rank != 1 || e.size != 2 || e.job != testJob {
				t.Fatalf("accepted a bad envelope: %+v, %v", e, err)
			}
		}
	})
}

// Two communicators in one process, connected by hand: bad addresses are
// refused with ErrInvalid naming the rank, before UCX sees them, and the
// communicator still connects with the right ones afterwards.
func TestConnectRefusesBadAddresses(t *testing.T) {
	cs := make([]*Comm, 2)
	for r := range cs {
		c, err := New(Config{Rank: r, Size: 2, Bootstrap: BootstrapExternal, Job: "manual"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		cs[r] = c
	}
	a0, a1 := cs[0].Address(), cs[1].Address()
	for _, bad := range [][]byte{flip(a1, 0, 0xff), flip(a1, 51, 0xff), randomBytes(300, 3), a1[:len(a1)-1]} {
		err := cs[0].Connect([][]byte{a0, bad})
		if !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), "rank 0: the address of rank 1") {
			t.Errorf("bad address: %v", err)
		}
	}
	if err := cs[0].Connect([][]byte{a1, a0}); !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), "not its own") {
		t.Errorf("swapped: %v", err)
	}
	other, err := New(Config{Rank: 1, Size: 2, Bootstrap: BootstrapExternal, Job: "another"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := cs[0].Connect([][]byte{a0, other.Address()}); !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), "belongs to another job") {
		t.Errorf("another job's address: %v", err)
	}
	for r, c := range cs {
		if err := c.Connect([][]byte{a0, a1}); err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// A local process that joins the embedded rendezvous as rank 1 and posts
// garbage (raw, or in a forged envelope) makes rank 0 fail with
// ErrRendezvous naming rank 1; it used to abort rank 0 inside UCX.
func TestForgedAddressThroughRendezvous(t *testing.T) {
	raw := realAddress(t)
	for _, forged := range [][]byte{
		randomBytes(300, 4),
		sealAddress(randomBytes(300, 5), nil, 1, 2, jobDigest("halo", "")),
		sealAddress(flip(raw, 0, 0xff), nil, 1, 2, jobDigest("halo", "")),
	} {
		addr := freeAddr(t)
		res := make(chan error)
		go func() {
			_, err := New(Config{Rank: 0, Size: 2, Rendezvous: addr, Job: "halo", BootstrapTimeout: 10 * time.Second})
			res <- err
		}()
		cfg := rendezvous.ClientConfig{Addr: addr, Job: "halo", Rank: 1, Size: 2, Timeout: 10 * time.Second}
		if _, err := rendezvous.Allgather(context.Background(), cfg, forged); err != nil {
			t.Fatalf("the forger: %v", err)
		}
		err := <-res
		if !errors.Is(err, halo.ErrRendezvous) || !strings.Contains(err.Error(), "rank 0: from the rendezvous: the address of rank 1 is") {
			t.Errorf("rank 0: %v", err)
		}
	}
}
