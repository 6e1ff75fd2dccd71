package rendezvous

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"reflect"
	"runtime"
	"testing"
)

// sampleMessages has one of each message, with fields set.
func sampleMessages() []Message {
	return []Message{
		&Hello{Version: ProtocolVersion, Token: "s3cret", Job: "train", Attempt: "3", Launch: "5f1b2c", Instance: 0x0123456789abcdef, Rank: 2, Size: 4},
		&Hello{Version: ProtocolVersion, Job: "j"},
		&Put{Key: "payload/2", Value: []byte("ucx-address-bytes\x00\xff")},
		&Put{Key: "k", Value: nil},
		&Get{WaitMillis: 10000, Keys: []string{"payload/0", "payload/1", "payload/2", "payload/3"}},
		&Get{},
		&Leave{},
		&Ack{},
		&Values{Values: [][]byte{[]byte("a0"), {}, []byte("a2")}},
		&Values{},
		&ErrorReply{Code: CodeTimeout, Message: "2 of 4 keys did not arrive within 10s", Missing: []uint32{2, 3}},
		&ErrorReply{Code: CodeUnauthorized, Message: "the server rejected the token"},
	}
}

// normalize maps empty slices to nil, which is how Decode returns them.
func normalize(m Message) Message {
	switch m := m.(type) {
	case *Put:
		c := *m
		if len(c.Value) == 0 {
			c.Value = []byte{}
		}
		return &c
	case *Values:
		c := *m
		c.Values = nil
		for _, v := range m.Values {
			if len(v) == 0 {
				v = []byte{}
			}
			c.Values = append(c.Values, v)
		}
		return &c
	}
	return m
}

func TestRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		body := AppendMessage(nil, m)
		got, err := Decode(body)
		if err != nil {
			t.Fatalf("%s: decode: %v", m.Type(), err)
		}
		if !reflect.DeepEqual(normalize(got), normalize(m)) {
			t.Errorf("%s: decoded %#v, want %#v", m.Type(), got, m)
		}
		// Every strict prefix is malformed, never a panic.
		for i := range body {
			if _, err := Decode(body[:i]); !errors.Is(err, ErrMalformed) {
				t.Errorf("%s: prefix of %d bytes: err = %v, want ErrMalformed", m.Type(), i, err)
			}
		}
		if _, err := Decode(append(bytes.Clone(body), 0)); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: trailing byte accepted", m.Type())
		}
	}
}

func TestFrames(t *testing.T) {
	var stream []byte
	for _, m := range sampleMessages() {
		stream = AppendFrame(stream, m)
	}
	r := bytes.NewReader(stream)
	for _, m := range sampleMessages() {
		body, err := ReadFrame(r, 1<<16)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(body, AppendMessage(nil, m)) {
			t.Fatalf("%s: frame body differs", m.Type())
		}
	}
	if _, err := ReadFrame(r, 1<<16); err != io.EOF {
		t.Fatalf("at end: err = %v, want io.EOF", err)
	}

	big := binary.BigEndian.AppendUint32(nil, 1<<20+1)
	if _, err := ReadFrame(bytes.NewReader(big), 1<<20); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("oversized: err = %v", err)
	}
	if _, err := ReadFrame(bytes.NewReader([]byte{0, 0, 0, 0}), 10); !errors.Is(err, ErrMalformed) {
		t.Errorf("empty frame: err = %v", err)
	}
	short := append(binary.BigEndian.AppendUint32(nil, 100), 1, 2, 3)
	if _, err := ReadFrame(bytes.NewReader(short), 1000); err != io.ErrUnexpectedEOF {
		t.Errorf("short body: err = %v", err)
	}
	if _, err := ReadFrame(bytes.NewReader([]byte{0, 0}), 1000); err != io.ErrUnexpectedEOF {
		t.Errorf("short header: err = %v", err)
	}
}

// A header that announces a big frame must not cost a big allocation before
// the bytes arrive.
func TestReadFrameAllocatesAsDataArrives(t *testing.T) {
	hdr := binary.BigEndian.AppendUint32(nil, 512<<20)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 10 {
		ReadFrame(bytes.NewReader(append(hdr, 1, 2, 3)), MaxFrameBytes)
	}
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > 10*2*readChunk {
		t.Errorf("10 truncated frames announcing 512 MiB allocated %d bytes", n)
	}
	// Nor does it ask the reader for more than a chunk at a time.
	r := &countingReader{r: bytes.NewReader(append(hdr, make([]byte, 100)...))}
	ReadFrame(r, MaxFrameBytes)
	if r.maxRead > readChunk {
		t.Errorf("asked the reader for %d bytes at once", r.maxRead)
	}
}

type countingReader struct {
	r       io.Reader
	maxRead int
}

func (c *countingReader) Read(p []byte) (int, error) {
	c.maxRead = max(c.maxRead, len(p))
	return c.r.Read(p)
}

func TestWriteValuesMatchesAppendFrame(t *testing.T) {
	for _, vals := range [][][]byte{nil, {{}}, {[]byte("x"), nil, bytes.Repeat([]byte{7}, 5000)}} {
		var buf bytes.Buffer
		if err := writeValues(&buf, vals); err != nil {
			t.Fatal(err)
		}
		if want := AppendFrame(nil, &Values{Values: vals}); !bytes.Equal(buf.Bytes(), want) {
			t.Errorf("writeValues(%d values) differs from AppendFrame", len(vals))
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	cases := map[string][]byte{
		"empty":        {},
		"unknown type": {0x7f},
		"bad magic":    append([]byte{byte(TypeHello)}, "HTTP/1.1 200 OK"...),
		"huge count":   {byte(TypeGet), 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff},
		"huge blob":    {byte(TypePut), 0, 1, 'k', 0xff, 0xff, 0xff, 0xff},
		"huge missing": {byte(TypeError), 1, 0, 0, 0x40, 0, 0, 0},
	}
	for name, body := range cases {
		if m, err := Decode(body); err == nil {
			t.Errorf("%s: decoded %#v", name, m)
		}
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range sampleMessages() {
		f.Add(AppendMessage(nil, m))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		m, err := Decode(body)
		if err != nil {
			if m != nil {
				t.Fatal("message and error")
			}
			return
		}
		// One encoding per message: decoding then encoding is the identity.
		if again := AppendMessage(nil, m); !bytes.Equal(again, body) {
			t.Fatalf("re-encoding %#v gives %x, not %x", m, again, body)
		}
	})
}

func FuzzReadFrame(f *testing.F) {
	var stream []byte
	for _, m := range sampleMessages() {
		stream = AppendFrame(stream, m)
	}
	f.Add(stream, uint16(64))
	f.Add([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), uint16(4096))
	f.Fuzz(func(t *testing.T, stream []byte, limit uint16) {
		r := bytes.NewReader(stream)
		for {
			body, err := ReadFrame(r, int(limit))
			if err != nil {
				return
			}
			if len(body) == 0 || len(body) > int(limit) {
				t.Fatalf("body of %d bytes with limit %d", len(body), limit)
			}
			Decode(body)
		}
	})
}
