package ucx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
)

// UCX unpacks a worker address (ucp_address_unpack, ucp/wireup/address.c)
// without knowing its length and trusts every field: in UCX 1.13 a bad
// version nibble fails ucs_assertv_always (SIGABRT), a negative or huge
// interface overhead fails an assertion in lane selection, a length that
// runs past the end reads whatever follows (SIGSEGV, or a loop that never
// ends). So a peer's address is checked here before ucp_ep_create sees it.
//
// The check has two parts:
//
//   - The header (version and flags) must equal our own worker's. Every
//     rank of a job runs the same UCX release with the same configuration,
//     so the header, which says how the rest is laid out, is the same on
//     every rank; anything else would trip UCX's version assertion or make
//     it read the address with the wrong layout.
//   - The body is walked with the layout of the loaded UCX's packed worker
//     address (versions 1 and 2, non-unified mode; 1.13 to 1.22 differ only
//     in version 1's MD index, 5 bits before 1.19 and 7 from 1.19): every length must stay inside
//     the address and the walk must end exactly at its end; the interface
//     attributes that lane selection computes with must be finite and
//     within physical bounds; indices must be within UCX's limits. The walk
//     is calibrated on our own address: if our own does not walk (another
//     UCX release, or UCX_UNIFIED_MODE, whose entries take their lengths
//     from the local worker), only the header is compared.
//
// What the walk cannot judge is the meaning of transport addresses (a port,
// a shared-memory segment id): halo's envelope around the address
// (comm/address.go) carries a checksum for those, and the rendezvous decides
// who may hand out an address at all.

// Layout constants of UCX's address format (ucp/wireup/address.c), 1.13 on.
const (
	addrVersionV1 = 0
	addrVersionV2 = 1

	addrFlagDebugInfo  = 1 << 0
	addrFlagWorkerUUID = 1 << 1
	addrFlagClientID   = 1 << 2

	addrNullResource = 0xff

	mdFlagEmptyDev = 0x80
	mdMaskV1       = 0x1f // before 1.19: the other two bits are MD capability flags
	mdMaskV1From19 = 0x7f // 1.19 on: the capability flags are gone
	mdMaskV2       = 0x7f // 0x7f: the index is in the next byte

	devFlagLast     = 0x80
	devFlagNumPaths = 0x40
	devFlagSysDev   = 0x20
	devLenMask      = 0x1f // 0x1f in v2: the length is in the next byte

	ifaceFlagLast    = 0x80
	ifaceFlagHasEP   = 0x40
	ifaceLenMask     = 0x3f // 0x3f in v2: the length is in the next byte
	ifaceAttrLenV1   = 16   // float overhead, bandwidth, lat_ovh; u32 prio and flags
	ifaceAttrLenV2   = 8    // fp8 overhead, bandwidth, latency; u8 prio; u16 seg size, flags
	maxAddrResources = 128
	pidNSLen         = 8  // a PID namespace id in posix and cuda_ipc addresses
	maxAddrMDs       = 64 // remote MD indices index 64-bit maps

	// Bounds on what a real interface reports: nobody's overhead or
	// latency is a second, nobody's bandwidth a petabyte per second.
	maxIfaceSeconds   = 1.0
	maxIfaceBandwidth = 1e15
)

// errAddress is wrapped by every error CheckAddress returns.
var errAddress = errors.New("not a worker address of this UCX")

// addrReader reads a packed address with bounds checks; the first failure
// sticks.
type addrReader struct {
	b   []byte
	off int
	err error
}

func (r *addrReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: byte %d: %s", errAddress, r.off, fmt.Sprintf(format, args...))
	}
}

func (r *addrReader) bytes(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b)-r.off {
		r.fail("%s of %d bytes runs past the end (%d bytes)", what, n, len(r.b))
		return nil
	}
	v := r.b[r.off : r.off+n]
	r.off += n
	return v
}

func (r *addrReader) u8(what string) byte {
	v := r.bytes(1, what)
	if v == nil {
		return 0
	}
	return v[0]
}

// extended reads a value packed in the low bits of b, or, in version 2 when
// those bits are all set, in the next byte.
func (r *addrReader) extended(b byte, mask byte, v2 bool, what string) int {
	if v2 && b&mask == mask {
		return int(r.u8(what))
	}
	return int(b & mask)
}

// addrHeader returns the version, the flags and the header's length.
func addrHeader(a []byte) (version, flags byte, n int, err error) {
	if len(a) == 0 {
		return 0, 0, 0, fmt.Errorf("%w: empty", errAddress)
	}
	version = a[0] & 0x0f
	switch version {
	case addrVersionV1:
		return version, a[0] >> 4, 1, nil
	case addrVersionV2:
		if len(a) < 2 {
			return 0, 0, 0, fmt.Errorf("%w: %d bytes, shorter than its header", errAddress, len(a))
		}
		return version, a[1], 2, nil
	}
	return 0, 0, 0, fmt.Errorf("%w: address version %d (UCX 1.13 knows 1 and 2, as 0 and 1)", errAddress, version)
}

// addrEntry is one transport address in a worker address.
type addrEntry struct {
	csum     uint16 // checksum of the transport's name
	attrOff  int    // where its interface attributes start
	ifaceOff int    // where its interface address starts
	ifaceLen int
}

// addrLayout is what a walk found: the transport entries, and where the
// contents of device and interface addresses lie (what the walk cannot
// judge; see above).
type addrLayout struct {
	entries  []addrEntry
	contents [][2]int // [start, end) byte ranges
}

// loadedMDMaskV1 is version 1's MD index mask for the UCX that is loaded.
var loadedMDMaskV1 = sync.OnceValue(func() byte {
	if major, minor := versionNumber(); major > 1 || major == 1 && minor >= 19 {
		return mdMaskV1From19
	}
	return mdMaskV1
})

// walkAddress walks a packed worker address laid out as the loaded UCX
// packs it and checks every field UCX would trust.
func walkAddress(a []byte) (*addrLayout, error) { return walkAddressWith(a, loadedMDMaskV1()) }

// walkAddressWith walks a with version 1's MD index mask mdMaskV1.
func walkAddressWith(a []byte, v1MDMask byte) (*addrLayout, error) {
	version, flags, n, err := addrHeader(a)
	if err != nil {
		return nil, err
	}
	v2 := version == addrVersionV2
	r := &addrReader{b: a, off: n}
	if flags&addrFlagWorkerUUID != 0 {
		r.bytes(8, "worker uuid")
	}
	if flags&addrFlagClientID != 0 {
		r.bytes(8, "client id")
	}
	if flags&addrFlagDebugInfo != 0 {
		r.bytes(int(r.u8("worker name length")), "worker name")
	}
	l := &addrLayout{}
	if r.err == nil && r.off < len(a) && a[r.off] == addrNullResource {
		r.off++
	} else {
		walkDevices(r, v2, v1MDMask, l)
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.off != len(a) {
		return nil, fmt.Errorf("%w: %d bytes, but its devices end at byte %d", errAddress, len(a), r.off)
	}
	return l, nil
}

func walkDevices(r *addrReader, v2 bool, v1MDMask byte, l *addrLayout) {
	mdMask, attrLen := v1MDMask, ifaceAttrLenV1
	if v2 {
		mdMask, attrLen = mdMaskV2, ifaceAttrLenV2
	}
	for dev := 0; r.err == nil; dev++ {
		mdByte := r.u8("md index")
		if md := r.extended(mdByte, mdMask, v2, "md index"); md >= maxAddrMDs {
			r.fail("device %d: md index %d, more than UCX's %d", dev, md, maxAddrMDs-1)
		}
		lenByte := r.u8("device address length")
		devLen := r.extended(lenByte, devLenMask, v2, "device address length")
		if lenByte&devFlagNumPaths != 0 {
			if r.u8("path count") == 0 {
				r.fail("device %d: zero paths", dev)
			}
		}
		if lenByte&devFlagSysDev != 0 {
			r.u8("system device")
		}
		l.contents = append(l.contents, [2]int{r.off, r.off + devLen})
		r.bytes(devLen, "device address")
		for last := mdByte&mdFlagEmptyDev != 0; !last && r.err == nil; {
			if len(l.entries) == maxAddrResources {
				r.fail("more than %d transport addresses", maxAddrResources)
				return
			}
			e := addrEntry{attrOff: r.off + 2}
			if cs := r.bytes(2, "transport name checksum"); cs != nil {
				e.csum = binary.LittleEndian.Uint16(cs)
			}
			checkIfaceAttr(r, r.bytes(attrLen, "interface attributes"), v2, dev)
			ifByte := r.u8("interface address length")
			last = ifByte&ifaceFlagLast != 0
			e.ifaceLen = r.extended(ifByte, ifaceLenMask, v2, "interface address length")
			e.ifaceOff = r.off
			l.contents = append(l.contents, [2]int{r.off, r.off + e.ifaceLen})
			r.bytes(e.ifaceLen, "interface address")
			if ifByte&ifaceFlagHasEP != 0 {
				// ucp_worker_get_address packs no endpoint; only wireup
				// messages carry endpoint addresses.
				r.fail("device %d: endpoint addresses in a worker address", dev)
			}
			l.entries = append(l.entries, e)
		}
		if lenByte&devFlagLast != 0 {
			return
		}
	}
}

// checkIfaceAttr checks the attributes lane selection computes scores from.
// Version 2 packs them as 8-bit floats, whose every value UCX decodes to a
// finite number; version 1 packs IEEE floats, which can be anything.
func checkIfaceAttr(r *addrReader, attr []byte, v2 bool, dev int) {
	if attr == nil || v2 {
		return
	}
	f := func(i int) float64 {
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(attr[4*i:])))
	}
	overhead, bandwidth, latency := f(0), f(1), f(2)
	switch {
	case !(overhead >= 0 && overhead <= maxIfaceSeconds):
		r.fail("device %d: interface overhead %g s is out of range", dev, overhead)
	case !(latency >= 0 && latency <= maxIfaceSeconds):
		r.fail("device %d: interface latency %g s is out of range", dev, latency)
	case !(bandwidth > 0 && bandwidth <= maxIfaceBandwidth):
		r.fail("device %d: interface bandwidth %g B/s is out of range", dev, bandwidth)
	}
}

// CheckAddress reports whether peer is a worker address that UCX, holding
// our own worker's address own, can unpack without tripping over it (see
// the comment at the top of this file). The error says what is wrong and
// where.
func CheckAddress(own, peer []byte) error {
	ov, of, on, err := addrHeader(own)
	if err != nil {
		return fmt.Errorf("ucx: our own address: %w", err)
	}
	pv, pf, _, err := addrHeader(peer)
	if err != nil {
		return err
	}
	if pv != ov || pf != of || peer[0] != own[0] {
		return fmt.Errorf("%w: header %x, but this worker's is %x (another UCX release or configuration?)",
			errAddress, peer[:on], own[:on])
	}
	ownLayout, err := walkAddress(own)
	if err != nil {
		return nil // a layout the walk does not know: the header is all we can check
	}
	layout, err := walkAddress(peer)
	if err != nil {
		return err
	}
	// UCX reads a transport's interface address with the lengths it knows
	// for it, whatever the entry says: a length byte flipped so that the
	// walk still ends at the end crashed UCX 1.13 in the probe test. But one
	// transport does not have one length: posix's and cuda_ipc's carry a PID
	// namespace id (ucs_sys_ns_t, 8 bytes) when a rank runs in its own, so a
	// containerised rank and a bare one differ by that. Entries of
	// transports this worker lacks are never used, so only those it has are
	// held to its lengths, give or take a namespace id.
	lens := make(map[uint16][]int)
	for _, e := range ownLayout.entries {
		lens[e.csum] = append(lens[e.csum], e.ifaceLen, e.ifaceLen+pidNSLen, e.ifaceLen-pidNSLen)
	}
	for i, e := range layout.entries {
		if want, ok := lens[e.csum]; ok && !slices.Contains(want, e.ifaceLen) {
			return fmt.Errorf("%w: transport address %d (name checksum %#04x) is %d bytes, but that transport's are %d (or %d more or less with a PID namespace id)",
				errAddress, i, e.csum, e.ifaceLen, want[0], pidNSLen)
		}
	}
	return nil
}

// CheckAddress checks a peer's address against this transport's own (see
// the package function).
func (t *Transport) CheckAddress(peer []byte) error { return CheckAddress(t.addr, peer) }
