package ucx

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// probeOptions confine a probing transport to shared memory and self:
// probing a flipped TCP address would dial whatever host the flipped bytes
// name.
var probeOptions = Options{Config: map[string]string{"TLS": "sm,self"}}

func openT(t testing.TB, opts Options) *Transport {
	t.Helper()
	tr, err := Open(0, 2, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// The walk must know this UCX's layout: if it did not, CheckAddress would
// quietly fall back to comparing headers.
func TestCheckAddressKnowsThisUCX(t *testing.T) {
	for _, opts := range []Options{{}, probeOptions, {Config: map[string]string{"TLS": "tcp,self"}}} {
		own := openT(t, opts).Address()
		layout, err := walkAddress(own)
		if err != nil {
			t.Fatalf("UCX %s, %v: our own address does not walk: %v", Version(), opts.Config, err)
		}
		if len(layout.entries) == 0 {
			t.Errorf("%v: no transport in our own address", opts.Config)
		}
		if err := CheckAddress(own, own); err != nil {
			t.Errorf("%v: own address rejected: %v", opts.Config, err)
		}
	}
}

func TestCheckAddressRejects(t *testing.T) {
	own := openT(t, Options{}).Address()
	layout, err := walkAddress(own)
	if err != nil {
		t.Fatal(err)
	}
	entries := layout.entries
	edit := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), own...)) }
	setF32 := func(b []byte, off int, v float32) []byte {
		binary.LittleEndian.PutUint32(b[off:], math.Float32bits(v))
		return b
	}
	e0 := entries[0].attrOff
	cases := []struct {
		name string
		addr []byte
		want string
	}{
		{"empty", nil, "empty"},
		{"version 15 (byte 0 flipped)", edit(func(b []byte) []byte { b[0] ^= 0xff; return b }), "address version 15"},
		{"version 2", edit(func(b []byte) []byte { b[0] = b[0]&0xf0 | 2; return b }), "address version 2"},
		{"other flags", edit(func(b []byte) []byte { b[0] ^= 0x40; return b }), "header"},
		{"truncated", own[:len(own)-1], "runs past the end"},
		{"one byte more", append(append([]byte(nil), own...), 0), "devices end at byte"},
		{"negative overhead", edit(func(b []byte) []byte { return setF32(b, e0, -1) }), "overhead -1 s"},
		{"huge overhead", edit(func(b []byte) []byte { return setF32(b, e0, 1e30) }), "overhead"},
		{"zero bandwidth", edit(func(b []byte) []byte { return setF32(b, e0+4, 0) }), "bandwidth 0"},
		{"NaN latency", edit(func(b []byte) []byte { return setF32(b, e0+8, float32(math.NaN())) }), "latency NaN"},
		{"interface address length", edit(func(b []byte) []byte { b[e0+16]++; return b }), ""},
		{"endpoint address", edit(func(b []byte) []byte { b[e0+16] |= ifaceFlagHasEP; return b }), ""},
	}
	for _, c := range cases {
		err := CheckAddress(own, c.addr)
		if err == nil || !errors.Is(err, errAddress) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want one with %q", c.name, err, c.want)
		}
	}
	// Every prefix is rejected, and so is every mangled byte that UCX 1.13
	// was seen to die of (the version nibble, every overhead's top byte).
	for n := range own {
		if CheckAddress(own, own[:n]) == nil {
			t.Errorf("prefix of %d bytes accepted", n)
		}
	}
	for _, e := range entries {
		for _, v := range []byte{0xff, 0x80, 0x7f, own[e.attrOff+3] ^ 0xff} {
			b := append([]byte(nil), own...)
			b[e.attrOff+3] = v
			if v != own[e.attrOff+3] && CheckAddress(own, b) == nil && float32Of(b, e.attrOff) < 0 {
				t.Errorf("negative overhead at byte %d accepted", e.attrOff+3)
			}
		}
	}
}

func float32Of(b []byte, off int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(b[off:]))
}

const probeChildEnv = "UCX_ADDRESS_PROBE_CHILD"

// Every single-byte change of a real address that CheckAddress lets through
// goes through ucp_ep_create without killing the process, except changes to
// the contents of device and transport addresses, which CheckAddress does
// not judge (a changed shared-memory segment id maps someone else's
// segment), and changes that make another well-formed layout (see
// restructured): the envelope's checksum guards those. The probing runs in a
// child process, which says which change it is about to try, so that an
// abort names the change.
func TestCheckedAddressesKeepUCXAlive(t *testing.T) {
	if os.Getenv(probeChildEnv) == "1" {
		probeAllFlips(t)
		return
	}
	if testing.Short() {
		t.Skip("probes tens of thousands of endpoints")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCheckedAddressesKeepUCXAlive$", "-test.v")
	cmd.Env = append(os.Environ(), probeChildEnv+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(2*time.Minute, func() { cmd.Process.Kill() })
	defer timer.Stop()
	var last, tail string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "probe ") {
			last = line
		} else {
			tail += line + "\n"
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("the probing process died (%v) at %q:\n%s", err, last, tail)
	}
	if !strings.Contains(tail, "probed ") {
		t.Fatalf("no summary from the probing process:\n%s", tail)
	}
	t.Log(strings.TrimSpace(tail))
}

func probeAllFlips(t *testing.T) {
	tr := openT(t, probeOptions)
	own := tr.Address()
	layout, err := walkAddress(own)
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(os.Stdout)
	accepted, connected, moved := 0, 0, 0
	b := make([]byte, len(own))
	for i := range own {
		if inContents(layout, i) {
			continue
		}
		for v := 0; v < 256; v++ {
			if byte(v) == own[i] {
				continue
			}
			copy(b, own)
			b[i] = byte(v)
			if CheckAddress(own, b) != nil {
				continue
			}
			if restructured(layout, b) {
				moved++
				continue
			}
			accepted++
			fmt.Fprintf(w, "probe byte %d: %#02x -> %#02x\n", i, own[i], v)
			w.Flush()
			if tr.probeAddress(b) == nil {
				connected++
			}
		}
	}
	fmt.Printf("probed %d accepted single-byte changes of a %d-byte address: %d made an endpoint; %d more made another well-formed layout, not probed\n",
		accepted, len(own), connected, moved)
}

// restructured reports whether the changed address b walks to other
// transport entries than own's layout: a length or flag byte changed so
// that the walk finds another structure ending at the same byte. About one
// address in 30 has such a byte, by the chance of its random contents (a
// device address length 0 -> 1 on the first device, for one); UCX 1.22 can
// crash on it (a NULL dereference in ucp_ep_create, seen in CI) and
// CheckAddress cannot tell it from a real peer's address of other
// transports. The envelope's CRC-32C guards it: comm never hands UCX an
// address that failed it (comm's TestAddressEnvelope changes every byte).
func restructured(own *addrLayout, b []byte) bool {
	l, err := walkAddress(b)
	if err != nil || len(l.entries) != len(own.entries) {
		return true
	}
	for i, e := range l.entries {
		if e.attrOff != own.entries[i].attrOff || e.ifaceLen != own.entries[i].ifaceLen {
			return true
		}
	}
	return false
}

func inContents(l *addrLayout, i int) bool {
	for _, c := range l.contents {
		if i >= c[0] && i < c[1] {
			return true
		}
	}
	return false
}

// contents lists the bytes of a layout's device and transport addresses.
func contents(a []byte, l *addrLayout) []string {
	var s []string
	for _, c := range l.contents {
		s = append(s, string(a[c[0]:c[1]]))
	}
	return s
}

var fuzzProbe struct {
	once sync.Once
	tr   *Transport
	err  error
}

// FuzzCheckAddress feeds CheckAddress edits of this worker's own address
// (first byte odd: pairs of position and value, then a length) and raw
// bytes (first byte even). What it accepts, and what still holds our own
// device and transport addresses (whose contents it does not judge), is
// handed to ucp_ep_create: an address that passes the check but trips UCX
// kills the fuzzer. testdata/fuzz/FuzzCheckAddress holds edits UCX 1.13
// died of: byte 0 (the version), an overhead's sign, an interface address
// length, and a random blob.
func FuzzCheckAddress(f *testing.F) {
	f.Add([]byte{1, 51, 0xc7})           // an overhead's sign, further in
	f.Add([]byte{0, 0x20, 1, 2, 3, 4})   // raw bytes with a plausible header
	f.Add([]byte{1, 200, 7, 3, 0x40, 0}) // two edits
	f.Fuzz(func(t *testing.T, data []byte) {
		fuzzProbe.once.Do(func() { fuzzProbe.tr, fuzzProbe.err = Open(0, 2, probeOptions) })
		if fuzzProbe.err != nil {
			t.Fatal(fuzzProbe.err)
		}
		tr := fuzzProbe.tr
		own := tr.Address()
		if len(data) == 0 {
			return
		}
		var addr []byte
		if data[0]&1 == 0 {
			addr = data[1:]
		} else {
			addr = append([]byte(nil), own...)
			rest := data[1:]
			for ; len(rest) >= 2; rest = rest[2:] {
				addr[int(rest[0])%len(addr)] = rest[1]
			}
			if len(rest) == 1 { // a trailing byte cuts or extends
				n := int(rest[0]) % (len(addr) + 8)
				addr = append(addr[:min(n, len(addr))], make([]byte, max(0, n-len(addr)))...)
			}
		}
		err := CheckAddress(own, addr)
		if err != nil {
			if !errors.Is(err, errAddress) || err.Error() == "" {
				t.Fatalf("error without its class: %v", err)
			}
			return
		}
		ownLayout, err1 := walkAddress(own)
		layout, err2 := walkAddress(addr)
		if err1 != nil || err2 != nil {
			t.Fatalf("accepted, but does not walk: %v, %v", err1, err2)
		}
		if slices.Equal(contents(own, ownLayout), contents(addr, layout)) {
			start := time.Now()
			tr.probeAddress(addr)
			if d := time.Since(start); d > 4*time.Second { // a hang, not a slow machine
				t.Fatalf("probe took %v", d)
			}
		}
	})
}

// v1Address packs a version 1 worker address with one device of MD index
// byte md and one transport entry of iface bytes: the layout of UCX 1.13 to
// 1.22 (no debug info, no uuid, plausible interface attributes).
func v1Address(md byte, iface []byte) []byte {
	a := []byte{addrVersionV1, md, devFlagLast, 0x34, 0x12}
	for _, v := range []float32{1e-6, 1e9, 1e-6} {
		a = binary.LittleEndian.AppendUint32(a, math.Float32bits(v))
	}
	a = append(a, 0, 0, 0, 0, ifaceFlagLast|byte(len(iface)))
	return append(a, iface...)
}

// From UCX 1.19 version 1's MD index has 7 bits: an index past UCX's 64
// MDs must be refused, which the 5-bit mask of 1.13 read as a small one.
func TestCheckAddressV1MDIndex(t *testing.T) {
	if _, err := walkAddressWith(v1Address(40, []byte{1, 2}), mdMaskV1From19); err != nil {
		t.Errorf("UCX 1.22 address with MD index 40 refused: %v", err)
	}
	_, err := walkAddressWith(v1Address(0x45, []byte{1, 2}), mdMaskV1From19)
	if err == nil || !strings.Contains(err.Error(), "md index 69") {
		t.Errorf("UCX 1.22 address with MD index 69: err = %v, want one naming md index 69", err)
	}
	if _, err := walkAddressWith(v1Address(0x45, []byte{1, 2}), mdMaskV1); err != nil {
		t.Errorf("UCX 1.13 reads byte 0x45 as MD 5 with a flag, refused: %v", err)
	}
	var major, minor int
	fmt.Sscanf(Version(), "%d.%d", &major, &minor)
	if want := byte(mdMaskV1From19); (major > 1 || minor >= 19) != (loadedMDMaskV1() == want) {
		t.Errorf("UCX %s: version 1 MD mask %#x", Version(), loadedMDMaskV1())
	}
}

// A peer's transport address may be longer or shorter than ours for the
// same transport by a PID namespace id (posix and cuda_ipc in a
// container): such a mix is accepted; other lengths are not.
func TestCheckAddressAcceptsLengthMix(t *testing.T) {
	own := openT(t, probeOptions).Address()
	layout, err := walkAddress(own)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range layout.entries {
		lenAt := e.ifaceOff - 1
		if own[0]&0x0f != addrVersionV1 || e.ifaceLen+8 > ifaceLenMask-1 {
			continue
		}
		peer := append([]byte(nil), own[:e.ifaceOff+e.ifaceLen]...)
		peer = append(peer, 1, 2, 3, 4, 5, 6, 7, 8) // a namespace id, say
		peer = append(peer, own[e.ifaceOff+e.ifaceLen:]...)
		peer[lenAt] += 8
		if err := CheckAddress(own, peer); err != nil {
			t.Errorf("entry %d (name checksum %#04x) 8 bytes longer than ours: %v", i, e.csum, err)
		}
		if CheckAddress(own, peer[:len(peer)-1]) == nil {
			t.Errorf("entry %d longer, address cut by a byte: accepted", i)
		}
		odd := append(append(append([]byte(nil), own[:e.ifaceOff+e.ifaceLen]...), 1, 2, 3), own[e.ifaceOff+e.ifaceLen:]...)
		odd[lenAt] += 3
		if err := CheckAddress(own, odd); err == nil || !strings.Contains(err.Error(), "bytes, but that transport's") {
			t.Errorf("entry %d 3 bytes longer than ours: err = %v, want a length refusal", i, err)
		}
	}
}
