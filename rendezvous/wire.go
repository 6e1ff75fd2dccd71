package rendezvous

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Wire format, in brief (docs/rendezvous.md has the whole of it):
//
//	frame = length:u32 body[length]        big-endian, 1 <= length <= limit
//	body  = type:u8 fields...
//	str   = len:u16 bytes[len]
//	blob  = len:u32 bytes[len]
//
// Every request gets exactly one reply, and a client sends its next request
// only after reading the reply to the previous one.

// ProtocolVersion is the version a client announces in its Hello. Version 2
// added the hello's launch and instance.
const ProtocolVersion = 2

// helloMagic opens every Hello, so that a stray HTTP probe or port scanner is
// told apart from an old or new client at the first frame.
const helloMagic = "HLRV"

// MsgType is the first byte of a frame body.
type MsgType uint8

// Requests have the high bit clear, replies have it set.
const (
	TypeHello  MsgType = 0x01
	TypePut    MsgType = 0x02
	TypeGet    MsgType = 0x03
	TypeLeave  MsgType = 0x04
	TypeAck    MsgType = 0x81
	TypeValues MsgType = 0x82
	TypeError  MsgType = 0x83
)

func (t MsgType) String() string {
	switch t {
	case TypeHello:
		return "hello"
	case TypePut:
		return "put"
	case TypeGet:
		return "get"
	case TypeLeave:
		return "leave"
	case TypeAck:
		return "ack"
	case TypeValues:
		return "values"
	case TypeError:
		return "error"
	}
	return fmt.Sprintf("type 0x%02x", uint8(t))
}

// Message is one decoded frame body: *Hello, *Put, *Get, *Leave, *Ack,
// *Values or *ErrorReply.
type Message interface {
	Type() MsgType
	appendFields(b []byte) []byte
}

// Hello opens a session: it authenticates the client and places it in the
// namespace of (Job, Attempt, Launch) as rank Rank of Size.
type Hello struct {
	Version uint8
	Token   string
	Job     string
	Attempt string
	// Launch names the launch the rank belongs to (what its launcher gave
	// every rank, digested): runs of one job id and attempt from different
	// launches never meet. Empty when nothing names the launch.
	Launch string
	// Instance is chosen at random by each Allgather call and kept across
	// its retries: a second process claiming a rank that a live one holds
	// has another instance.
	Instance uint64
	Rank     uint32
	Size     uint32
}

// Put stores Value under Key, once: writing the same value again is
// accepted (a retrying client does that), writing a different one fails the
// job.
type Put struct {
	Key   string
	Value []byte
}

// Get waits up to WaitMillis for all Keys to exist and returns their values
// in the same order.
type Get struct {
	WaitMillis uint32
	Keys       []string
}

// Leave says that this rank is done with the namespace. Once every rank has
// left, the server forgets the job.
type Leave struct{}

// Ack is the reply to Hello, Put and Leave.
type Ack struct{}

// Values is the reply to Get.
type Values struct {
	Values [][]byte
}

// ErrorReply is the reply to any request that failed. Missing, set only with
// CodeTimeout, lists the positions in the Get's Keys that did not arrive.
type ErrorReply struct {
	Code    Code
	Message string
	Missing []uint32
}

func (*Hello) Type() MsgType      { return TypeHello }
func (*Put) Type() MsgType        { return TypePut }
func (*Get) Type() MsgType        { return TypeGet }
func (*Leave) Type() MsgType      { return TypeLeave }
func (*Ack) Type() MsgType        { return TypeAck }
func (*Values) Type() MsgType     { return TypeValues }
func (*ErrorReply) Type() MsgType { return TypeError }

// Field limits that follow from the encoding itself. The server applies
// tighter ones of its own.
const (
	maxStr      = 1<<16 - 1
	frameHeader = 4
	// MaxFrameBytes is the largest frame body either side will ever accept.
	MaxFrameBytes = 1 << 30
)

func appendStr(b []byte, s string) []byte {
	if len(s) > maxStr {
		panic("rendezvous: string field longer than 65535 bytes")
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

func appendBlob(b []byte, v []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
	return append(b, v...)
}

func (m *Hello) appendFields(b []byte) []byte {
	b = append(b, helloMagic...)
	b = append(b, m.Version)
	b = appendStr(b, m.Token)
	b = appendStr(b, m.Job)
	b = appendStr(b, m.Attempt)
	b = appendStr(b, m.Launch)
	b = binary.BigEndian.AppendUint64(b, m.Instance)
	b = binary.BigEndian.AppendUint32(b, m.Rank)
	return binary.BigEndian.AppendUint32(b, m.Size)
}

func (m *Put) appendFields(b []byte) []byte {
	b = appendStr(b, m.Key)
	return appendBlob(b, m.Value)
}

func (m *Get) appendFields(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, m.WaitMillis)
	b = binary.BigEndian.AppendUint32(b, uint32(len(m.Keys)))
	for _, k := range m.Keys {
		b = appendStr(b, k)
	}
	return b
}

func (*Leave) appendFields(b []byte) []byte { return b }
func (*Ack) appendFields(b []byte) []byte   { return b }

func (m *Values) appendFields(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(m.Values)))
	for _, v := range m.Values {
		b = appendBlob(b, v)
	}
	return b
}

func (m *ErrorReply) appendFields(b []byte) []byte {
	b = append(b, uint8(m.Code))
	b = appendStr(b, m.Message)
	b = binary.BigEndian.AppendUint32(b, uint32(len(m.Missing)))
	for _, i := range m.Missing {
		b = binary.BigEndian.AppendUint32(b, i)
	}
	return b
}

// AppendMessage appends m's body (without the frame header) to b.
// It panics if a string field is longer than 65535 bytes.
func AppendMessage(b []byte, m Message) []byte {
	b = append(b, uint8(m.Type()))
	return m.appendFields(b)
}

// AppendFrame appends m as a whole frame, length header included.
func AppendFrame(b []byte, m Message) []byte {
	start := len(b)
	b = append(b, 0, 0, 0, 0)
	b = AppendMessage(b, m)
	binary.BigEndian.PutUint32(b[start:], uint32(len(b)-start-frameHeader))
	return b
}

// ErrMalformed is wrapped by every error Decode returns.
var ErrMalformed = errors.New("malformed message")

// ErrFrameTooLarge is returned by ReadFrame for a frame over its limit.
var ErrFrameTooLarge = errors.New("frame too large")

// decoder reads fields from a body. The first failure sticks, so the parse
// functions read straight through and check once at the end.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated %s", ErrMalformed, what)
	}
	d.b = nil
}

func (d *decoder) bytes(n int, what string) []byte {
	if d.err != nil || n > len(d.b) {
		d.fail(what)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8(what string) uint8 {
	v := d.bytes(1, what)
	if v == nil {
		return 0
	}
	return v[0]
}

func (d *decoder) u16(what string) uint16 {
	v := d.bytes(2, what)
	if v == nil {
		return 0
	}
	return binary.BigEndian.Uint16(v)
}

func (d *decoder) u32(what string) uint32 {
	v := d.bytes(4, what)
	if v == nil {
		return 0
	}
	return binary.BigEndian.Uint32(v)
}

func (d *decoder) u64(what string) uint64 {
	v := d.bytes(8, what)
	if v == nil {
		return 0
	}
	return binary.BigEndian.Uint64(v)
}

func (d *decoder) str(what string) string {
	n := d.u16(what)
	return string(d.bytes(int(n), what))
}

// blob returns a sub-slice of the body, not a copy.
func (d *decoder) blob(what string) []byte {
	n := d.u32(what)
	if d.err != nil || uint64(n) > uint64(len(d.b)) {
		d.fail(what)
		return nil
	}
	return d.bytes(int(n), what)
}

// count reads a list length and checks it against what is left of the body,
// given the smallest encoding of one element, so that a lying count can
// never make the caller allocate more than the body could hold.
func (d *decoder) count(minElem int, what string) int {
	n := d.u32(what + " count")
	if d.err != nil {
		return 0
	}
	if uint64(n)*uint64(minElem) > uint64(len(d.b)) {
		d.fail(what)
		return 0
	}
	return int(n)
}

// Decode parses one frame body. Blobs in the result alias body; strings are
// copies. It never panics, and it allocates at most a small multiple of
// len(body). A successful Decode re-encodes to exactly body with
// AppendMessage: every message has one encoding.
func Decode(body []byte) (Message, error) {
	if len(body) == 0 {
		return nil, fmt.Errorf("%w: empty body", ErrMalformed)
	}
	d := &decoder{b: body[1:]}
	var m Message
	switch t := MsgType(body[0]); t {
	case TypeHello:
		if magic := d.bytes(len(helloMagic), "hello magic"); d.err == nil && string(magic) != helloMagic {
			return nil, fmt.Errorf("%w: hello without the protocol's magic (not a rendezvous client?)", ErrMalformed)
		}
		h := &Hello{}
		h.Version = d.u8("version")
		h.Token = d.str("token")
		h.Job = d.str("job")
		h.Attempt = d.str("attempt")
		h.Launch = d.str("launch")
		h.Instance = d.u64("instance")
		h.Rank = d.u32("rank")
		h.Size = d.u32("size")
		m = h
	case TypePut:
		p := &Put{}
		p.Key = d.str("key")
		p.Value = d.blob("value")
		m = p
	case TypeGet:
		g := &Get{}
		g.WaitMillis = d.u32("wait")
		n := d.count(2, "keys")
		if n > 0 {
			g.Keys = make([]string, n)
			for i := range g.Keys {
				g.Keys[i] = d.str("key")
			}
		}
		m = g
	case TypeLeave:
		m = &Leave{}
	case TypeAck:
		m = &Ack{}
	case TypeValues:
		v := &Values{}
		n := d.count(4, "values")
		if n > 0 {
			v.Values = make([][]byte, n)
			for i := range v.Values {
				v.Values[i] = d.blob("value")
			}
		}
		m = v
	case TypeError:
		e := &ErrorReply{}
		e.Code = Code(d.u8("code"))
		e.Message = d.str("message")
		n := d.count(4, "missing")
		if n > 0 {
			e.Missing = make([]uint32, n)
			for i := range e.Missing {
				e.Missing[i] = d.u32("missing")
			}
		}
		m = e
	default:
		return nil, fmt.Errorf("%w: unknown message type 0x%02x", ErrMalformed, uint8(t))
	}
	if d.err != nil {
		return nil, fmt.Errorf("%s: %w", m.Type(), d.err)
	}
	if len(d.b) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes after %s", ErrMalformed, len(d.b), m.Type())
	}
	return m, nil
}

// readChunk bounds how much ReadFrame allocates ahead of the bytes that
// actually arrive: a peer that announces a large frame and then stalls costs
// at most this much.
const readChunk = 64 << 10

// ReadFrame reads one frame from r and returns its body. A header announcing
// more than limit bytes (or an empty body) returns ErrFrameTooLarge (or
// ErrMalformed) without reading the body. EOF before the first header byte
// is io.EOF; EOF anywhere later is io.ErrUnexpectedEOF.
func ReadFrame(r io.Reader, limit int) ([]byte, error) {
	return readFrame(r, limit, readChunk)
}

// readFrame is ReadFrame allocating up to ahead bytes before they arrive. A
// client, reading from the server it chose, allocates a reply at once.
func readFrame(r io.Reader, limit, ahead int) ([]byte, error) {
	var hdr [frameHeader]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n == 0 {
		return nil, fmt.Errorf("%w: empty frame", ErrMalformed)
	}
	if limit > MaxFrameBytes {
		limit = MaxFrameBytes
	}
	if uint64(n) > uint64(limit) {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrFrameTooLarge, n, limit)
	}
	body := make([]byte, 0, min(int(n), ahead))
	for len(body) < int(n) {
		want := min(int(n)-len(body), max(ahead, cap(body)-len(body)))
		body = growTo(body, len(body)+want, int(n))
		k, err := io.ReadFull(r, body[len(body)-want:])
		body = body[:len(body)-want+k]
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return body, nil
}

// growTo returns b extended to length n, reallocating (doubling, but never
// past total) when the capacity runs out.
func growTo(b []byte, n, total int) []byte {
	if n <= cap(b) {
		return b[:n]
	}
	nb := make([]byte, n, min(max(n, 2*cap(b)), total))
	copy(nb, b)
	return nb
}
