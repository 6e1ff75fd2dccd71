package rendezvous

import (
	"bufio"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

var fuzzServer struct {
	once sync.Once
	s    *Server
}

// FuzzSession drives a real server's session with whatever a client sends:
// the fuzzed bytes are the client's side of one connection (over net.Pipe),
// against one server that lives across inputs, so that jobs, claims and
// failures left by earlier inputs meet later ones. Every reply must be a
// well-formed frame, the session must end once the client hangs up, and
// the server's books must balance afterwards.
func FuzzSession(f *testing.F) {
	frames := func(ms ...Message) []byte {
		var b []byte
		for _, m := range ms {
			b = AppendFrame(b, m)
		}
		return b
	}
	hello := func(rank, size uint32, instance uint64) *Hello {
		return &Hello{Version: ProtocolVersion, Token: testToken, Job: "fz", Rank: rank, Size: size, Instance: instance}
	}
	keys := []string{payloadKey(0), payloadKey(1)}
	f.Add(frames(hello(0, 2, 1), &Put{Key: payloadKey(0), Value: []byte("a")}, &Get{WaitMillis: 20, Keys: keys}, &Leave{}))
	f.Add(frames(hello(1, 2, 2), &Put{Key: payloadKey(1), Value: []byte("b")}, &Get{WaitMillis: 20, Keys: keys}, &Leave{}))
	f.Add(frames(hello(1, 2, 3), &Put{Key: payloadKey(0), Value: []byte("forged")}))
	f.Add(frames(hello(0, 3, 4), &Get{Keys: keys}))
	f.Add(frames(hello(0, 2, 5), hello(0, 2, 5)))
	f.Add(frames(&Hello{Version: 1, Job: "old"}))
	f.Add(frames(&Put{Key: "k/0"}, &Leave{}))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		fuzzServer.once.Do(func() {
			s, err := NewServer(ServerConfig{Token: testToken, MaxJobs: 64, MaxKeysPerJob: 64, MaxJobBytes: 1 << 20,
				MaxMessageBytes: 1 << 16, MaxConns: 64, MaxUnauthenticated: 8, IdleTimeout: 200 * time.Millisecond,
				HelloTimeout: 100 * time.Millisecond, MaxWait: 50 * time.Millisecond, JobTTL: time.Second})
			if err != nil {
				panic(err)
			}
			fuzzServer.s = s
		})
		s := fuzzServer.s
		client, server := net.Pipe()
		s.admit(server)
		replies := make(chan error, 1)
		go func() {
			br := bufio.NewReader(client)
			for {
				body, err := readFrame(br, MaxFrameBytes, 1<<16)
				if err != nil {
					if err == io.EOF || err == io.ErrClosedPipe {
						err = nil
					}
					replies <- err
					return
				}
				m, err := Decode(body)
				if err != nil {
					replies <- err
					return
				}
				if m.Type()&0x80 == 0 {
					replies <- errors.New("the server sent a request: " + m.Type().String())
					return
				}
			}
		}()
		client.SetWriteDeadline(time.Now().Add(time.Second))
		client.Write(in) // the server may stop reading early; that is fine
		time.Sleep(time.Millisecond)
		client.Close()
		if err := <-replies; err != nil {
			t.Fatalf("bad reply: %v", err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			s.mu.Lock()
			_, open := s.sessions[serverSession(s, server)]
			authed, pending := s.authed, len(s.pending)
			refs := 0
			for _, j := range s.jobs {
				refs += j.refs
			}
			s.mu.Unlock()
			if !open {
				if authed != 0 || refs != 0 || pending != 0 {
					t.Fatalf("books do not balance: %d authenticated sessions, %d job references, %d pending", authed, refs, pending)
				}
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("the session outlived its client by 5 s")
			}
			time.Sleep(time.Millisecond)
		}
	})
}

// serverSession finds the session serving conn, or nil once it has ended.
func serverSession(s *Server, conn net.Conn) *session {
	for ss := range s.sessions {
		if ss.conn == conn {
			return ss
		}
	}
	return nil
}
