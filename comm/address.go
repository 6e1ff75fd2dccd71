package comm

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// A rank's address, as Address hands it out and Connect and the rendezvous
// take it back, is UCX's worker address inside halo's envelope:
//
//	magic "HALA" | version u8 = 2 | reserved u8 = 0 | rank u32 | size u32 |
//	job [16] | length u32 | UCX's bytes [length] |
//	live length u16 | liveness section [live length] | CRC-32C u32
//
// (integers big-endian; job is the first 16 bytes of a SHA-256 of the job
// id and attempt; the liveness section says where the rank's liveness
// listener is, liveness.go, and is empty when it has none; the checksum
// covers everything before it). UCX trusts
// every byte of the address it is given, and a wrong one aborts the process
// (see ucx/address.go), so nothing reaches UCX unless the envelope is whole,
// was made for this rank's slot by a rank of a job of the same size and
// name, and its contents pass ucx.CheckAddress. Corruption anywhere, the
// contents of transport addresses included, fails the checksum.
const (
	addrMagic      = "HALA"
	addrVersion    = 2
	addrHeaderLen  = 4 + 1 + 1 + 4 + 4 + 16 + 4
	addrTrailerLen = 2 + 4 // the liveness section's length, the checksum
	maxLiveLen     = 2 + 16 + 16 + 1 + maxLiveIPs*17
	// maxAddrLen bounds UCX's part: a worker address with every device of
	// a large InfiniBand host is a few KiB.
	maxAddrLen = 1 << 16
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// jobDigest names a job in an envelope.
func jobDigest(job, attempt string) (d [16]byte) {
	h := sha256.Sum256([]byte("halo address\x00" + job + "\x00" + attempt))
	copy(d[:], h[:])
	return d
}

// envelope is an opened address.
type envelope struct {
	rank, size int
	job        [16]byte
	ucx        []byte // aliases the input
	live       []byte // the liveness section; aliases the input
}

// sealAddress puts UCX's address of rank (of size) and its liveness section
// in the envelope.
func sealAddress(ucx, live []byte, rank, size int, job [16]byte) []byte {
	b := make([]byte, 0, addrHeaderLen+len(ucx)+len(live)+addrTrailerLen)
	b = append(b, addrMagic...)
	b = append(b, addrVersion, 0)
	b = binary.BigEndian.AppendUint32(b, uint32(rank))
	b = binary.BigEndian.AppendUint32(b, uint32(size))
	b = append(b, job[:]...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(ucx)))
	b = append(b, ucx...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(live)))
	b = append(b, live...)
	return binary.BigEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

var errEnvelope = errors.New("not a halo address (what halo_comm_get_address returns)")

// openAddress checks the envelope's form and checksum and returns what it
// holds. It does not judge the contents (see checkAddress).
func openAddress(b []byte) (envelope, error) {
	var e envelope
	switch {
	case len(b) < addrHeaderLen+addrTrailerLen:
		return e, fmt.Errorf("%w: %d bytes, shorter than the envelope's %d", errEnvelope, len(b), addrHeaderLen+addrTrailerLen)
	case string(b[:4]) != addrMagic:
		return e, fmt.Errorf("%w: it does not start with %q", errEnvelope, addrMagic)
	case b[4] != addrVersion:
		return e, fmt.Errorf("%w: envelope version %d, this library reads %d (a different halo release?)", errEnvelope, b[4], addrVersion)
	case b[5] != 0:
		return e, fmt.Errorf("%w: reserved byte is %d", errEnvelope, b[5])
	}
	n := binary.BigEndian.Uint32(b[addrHeaderLen-4:])
	if n > maxAddrLen || uint64(len(b)) < uint64(addrHeaderLen)+uint64(n)+addrTrailerLen {
		return e, fmt.Errorf("%w: %d bytes, but its header says at least %d", errEnvelope, len(b), uint64(addrHeaderLen)+uint64(n)+addrTrailerLen)
	}
	at := addrHeaderLen + int(n)
	m := int(binary.BigEndian.Uint16(b[at:]))
	if want := at + 2 + m + 4; m > maxLiveLen || len(b) != want {
		return e, fmt.Errorf("%w: %d bytes, but its header says %d", errEnvelope, len(b), want)
	}
	body := b[:len(b)-4]
	if got, want := crc32.Checksum(body, castagnoli), binary.BigEndian.Uint32(b[len(body):]); got != want {
		return e, fmt.Errorf("%w: checksum mismatch (%08x, expected %08x): the bytes were changed on the way", errEnvelope, got, want)
	}
	e.rank = int(binary.BigEndian.Uint32(b[6:]))
	e.size = int(binary.BigEndian.Uint32(b[10:]))
	copy(e.job[:], b[14:30])
	e.ucx = b[addrHeaderLen:at]
	e.live = b[at+2 : at+2+m]
	return e, nil
}

// checkAddresses opens every rank's address and returns UCX's parts and the
// liveness sections. own is this rank's sealed address, check judges another
// rank's UCX address. The error says which rank's address is wrong and how;
// it is not classed.
func checkAddresses(addrs [][]byte, rank int, own []byte, job [16]byte, check func([]byte) error) (raw, live [][]byte, err error) {
	size := len(addrs)
	raw, live = make([][]byte, size), make([][]byte, size)
	for r, a := range addrs {
		if r == rank {
			if !bytes.Equal(a, own) {
				return nil, nil, fmt.Errorf("the address given for this rank (%d) is not its own (addresses out of order?)", rank)
			}
			continue
		}
		e, err := openAddress(a)
		if err != nil {
			return nil, nil, fmt.Errorf("the address of rank %d is %v", r, err)
		}
		switch {
		case e.rank != r || e.size != size:
			return nil, nil, fmt.Errorf("the address given for rank %d was made by rank %d of %d (addresses out of order, or from another group?)", r, e.rank, e.size)
		case e.job != job:
			return nil, nil, fmt.Errorf("the address of rank %d belongs to another job (its job id or attempt differs)", r)
		}
		if len(e.live) > 0 {
			if _, err := decodeLiveEndpoint(e.live); err != nil {
				return nil, nil, fmt.Errorf("the address of rank %d is %v: %v", r, errEnvelope, err)
			}
		}
		if err := check(e.ucx); err != nil {
			return nil, nil, fmt.Errorf("the address of rank %d is unusable: %v", r, err)
		}
		raw[r], live[r] = e.ucx, e.live
	}
	return raw, live, nil
}
