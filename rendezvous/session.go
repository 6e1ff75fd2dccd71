package rendezvous

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/rs/zerolog"
)

// session serves one client connection, one request at a time.
type session struct {
	srv  *Server
	conn net.Conn
	br   *bufio.Reader
	log  zerolog.Logger
	job  *job
	rank int
	left bool
}

func (ss *session) serve() {
	s := ss.srv
	defer func() {
		ss.conn.Close()
		s.mu.Lock()
		delete(s.sessions, ss)
		if ss.job != nil {
			ss.job.refs--
			ss.job.touched = time.Now()
		}
		s.mu.Unlock()
		s.wg.Done()
	}()
	ss.log.Debug().Msg("client connected")
	limit := helloLimit
	for {
		if !ss.armReadDeadline() {
			return
		}
		body, err := ReadFrame(ss.br, limit)
		if err != nil {
			ss.readFailed(err)
			return
		}
		m, err := Decode(body)
		if err != nil {
			ss.drop(CodeBadRequest, err.Error(), "dropping client: malformed message")
			return
		}
		reply, keep := ss.handle(m)
		if reply != nil {
			if err := ss.write(reply); err != nil {
				ss.log.Warn().Err(err).Stringer("reply", reply.Type()).Msg("dropping client: write failed")
				return
			}
		}
		if !keep {
			return
		}
		if ss.job != nil {
			limit = s.cfg.MaxMessageBytes
		}
	}
}

// armReadDeadline gives the next request IdleTimeout to arrive. It takes the
// server's lock so that it cannot undo the deadline Shutdown sets to wake
// idle sessions; it returns false once the server is closing.
func (ss *session) armReadDeadline() bool {
	s := ss.srv
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return false
	}
	ss.conn.SetReadDeadline(time.Now().Add(s.cfg.IdleTimeout))
	return true
}

func (ss *session) readFailed(err error) {
	closing := ss.srv.isClosing()
	switch {
	case err == io.EOF:
		ss.log.Debug().Msg("client disconnected")
	case closing:
		ss.log.Debug().Err(err).Msg("closing connection: server shutting down")
	case errors.Is(err, os.ErrDeadlineExceeded):
		ss.log.Warn().Dur("idle_timeout", ss.srv.cfg.IdleTimeout).Msg("dropping stalled client")
	case errors.Is(err, ErrFrameTooLarge):
		ss.drop(CodeTooLarge, err.Error(), "dropping client: message too large")
	case errors.Is(err, ErrMalformed):
		ss.drop(CodeBadRequest, err.Error(), "dropping client: malformed frame")
	default:
		ss.log.Warn().Err(err).Msg("dropping client: read failed")
	}
}

// drop logs why a client is cut off and tells it, as far as it still listens.
func (ss *session) drop(code Code, msg, logMsg string) {
	ss.log.Warn().Str("error", msg).Msg(logMsg)
	if ss.write(&ErrorReply{Code: code, Message: msg}) == nil {
		ss.lingerClose()
	}
}

// Bounds on lingerClose.
const (
	lingerTime  = time.Second
	lingerBytes = 64 << 20
)

// lingerClose half-closes the connection and discards what the client is
// still sending, for a while, before the caller closes it. A client cut off
// in the middle of writing a large put would otherwise get a reset before
// it could read why.
func (ss *session) lingerClose() {
	tcp, ok := ss.conn.(*net.TCPConn)
	if !ok || ss.srv.isClosing() {
		return
	}
	tcp.CloseWrite()
	tcp.SetReadDeadline(time.Now().Add(lingerTime))
	io.CopyN(io.Discard, ss.br, lingerBytes)
}

func (ss *session) write(m Message) error {
	ss.conn.SetWriteDeadline(time.Now().Add(ss.srv.cfg.IdleTimeout))
	if v, ok := m.(*Values); ok {
		return writeValues(ss.conn, v.Values)
	}
	_, err := ss.conn.Write(AppendFrame(nil, m))
	return err
}

// writeValues writes a Values frame straight from the stored values, in a
// few writev calls, so that answering a thousand ranks neither builds a
// thousand copies of the result nor takes a syscall per value. It produces
// the same bytes as AppendFrame.
func writeValues(w io.Writer, values [][]byte) error {
	n := 1 + 4
	for _, v := range values {
		n += 4 + len(v)
	}
	hdr := make([]byte, 4+1+4+4*len(values))
	binary.BigEndian.PutUint32(hdr[0:], uint32(n))
	hdr[4] = byte(TypeValues)
	binary.BigEndian.PutUint32(hdr[5:], uint32(len(values)))
	bufs := make(net.Buffers, 0, 1+2*len(values))
	bufs = append(bufs, hdr[:9])
	for i, v := range values {
		l := hdr[9+4*i : 9+4*i+4]
		binary.BigEndian.PutUint32(l, uint32(len(v)))
		bufs = append(bufs, l, v)
	}
	_, err := bufs.WriteTo(w)
	return err
}

func badRequest(format string, args ...any) *ErrorReply {
	return &ErrorReply{Code: CodeBadRequest, Message: fmt.Sprintf(format, args...)}
}

// handle answers one request. keep is false when the connection should be
// closed after the reply.
func (ss *session) handle(m Message) (reply Message, keep bool) {
	if h, ok := m.(*Hello); ok {
		return ss.hello(h)
	}
	var r *ErrorReply
	switch {
	case ss.job == nil:
		r = badRequest("the first message must be hello, not %s", m.Type())
	case ss.left:
		r = badRequest("%s after leave", m.Type())
	}
	if r == nil {
		switch m := m.(type) {
		case *Put:
			return ss.put(m)
		case *Get:
			return ss.get(m)
		case *Leave:
			return ss.leave()
		default:
			r = badRequest("%s is not a request", m.Type())
		}
	}
	ss.log.Warn().Str("error", r.Message).Msg("dropping client: protocol violation")
	return r, false
}

func (ss *session) hello(h *Hello) (Message, bool) {
	s := ss.srv
	if ss.job != nil {
		ss.log.Warn().Msg("dropping client: second hello")
		return badRequest("second hello on one connection"), false
	}
	if h.Version != ProtocolVersion {
		ss.log.Warn().Int("version", int(h.Version)).Msg("dropping client: unsupported protocol version")
		return &ErrorReply{Code: CodeVersion, Message: fmt.Sprintf("client speaks protocol version %d, server %d", h.Version, ProtocolVersion)}, false
	}
	if !s.tokenOK(h.Token) {
		ss.log.Warn().Str("job", h.Job).Msg("rejecting client: bad token")
		return &ErrorReply{Code: CodeUnauthorized, Message: "the server rejected the token"}, false
	}
	var r *ErrorReply
	switch {
	case h.Job == "" || len(h.Job) > maxJobLen:
		r = badRequest("job id must be 1 to %d bytes long, got %d", maxJobLen, len(h.Job))
	case len(h.Attempt) > maxAttemptLen:
		r = badRequest("attempt id must be at most %d bytes long, got %d", maxAttemptLen, len(h.Attempt))
	case h.Size == 0:
		r = badRequest("job size must be at least 1")
	case uint64(h.Size) > uint64(s.cfg.MaxKeysPerJob):
		r = &ErrorReply{Code: CodeLimit, Message: fmt.Sprintf("a job of %d ranks is more than this server's limit of %d", h.Size, s.cfg.MaxKeysPerJob)}
	}
	if r != nil {
		ss.log.Warn().Str("job", h.Job).Str("error", r.Message).Msg("rejecting client")
		return r, false
	}

	rank, size := int(h.Rank), int(h.Size)
	log := ss.log.With().Str("job", h.Job).Str("attempt", h.Attempt).Int("rank", rank).Logger()
	now := time.Now()
	s.mu.Lock()
	j, r := s.jobForLocked(h, now)
	if r == nil && j.failed == nil {
		switch {
		case size != j.size:
			r = j.fail(CodeMismatch, fmt.Sprintf("rank %d says the job has %d ranks, but rank %d said %d", rank, size, j.sizeFrom, j.size))
			log.Warn().Int("size", size).Int("expected_size", j.size).Msg("job failed: ranks disagree on its size")
		case rank >= size:
			r = j.fail(CodeMismatch, fmt.Sprintf("rank %d is out of range for a job of %d ranks", rank, size))
			log.Warn().Int("size", size).Msg("job failed: rank out of range")
		}
	} else if r == nil {
		r = j.failed
	}
	if r == nil {
		j.refs++
		j.touched = now
		ss.job, ss.rank, ss.log = j, rank, log
	}
	s.mu.Unlock()
	if r != nil {
		return r, false
	}
	ss.log.Debug().Int("size", size).Msg("client joined")
	return &Ack{}, true
}

func checkKey(k string) *ErrorReply {
	if k == "" || len(k) > maxKeyLen {
		return badRequest("key must be 1 to %d bytes long, got %d", maxKeyLen, len(k))
	}
	return nil
}

func (ss *session) put(p *Put) (Message, bool) {
	s := ss.srv
	if r := checkKey(p.Key); r != nil {
		ss.log.Warn().Str("error", r.Message).Msg("dropping client: bad key")
		return r, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	j := ss.job
	j.touched = time.Now()
	if j.failed != nil {
		return j.failed, true
	}
	if old, ok := j.values[p.Key]; ok {
		if bytes.Equal(old.value, p.Value) {
			return &Ack{}, true // a retry
		}
		ss.log.Warn().Str("key", p.Key).Int("first_rank", old.rank).Msg("job failed: two different values for one key")
		return j.fail(CodeMismatch, fmt.Sprintf(
			"rank %d wrote key %q, which rank %d had already written with a different value (two processes with the same rank, or a restarted job that reused its attempt id)",
			ss.rank, p.Key, old.rank)), true
	}
	if len(j.values) >= s.cfg.MaxKeysPerJob {
		ss.log.Warn().Int("max_keys", s.cfg.MaxKeysPerJob).Msg("job failed: key limit reached")
		return j.fail(CodeLimit, fmt.Sprintf("the job would store more than %d keys, this server's limit", s.cfg.MaxKeysPerJob)), true
	}
	if n := len(p.Key) + len(p.Value); j.bytes+n > s.cfg.MaxJobBytes {
		ss.log.Warn().Int("max_job_bytes", s.cfg.MaxJobBytes).Msg("job failed: byte limit reached")
		return j.fail(CodeLimit, fmt.Sprintf("the job would store more than %d bytes, this server's limit", s.cfg.MaxJobBytes)), true
	}
	j.values[p.Key] = entry{value: bytes.Clone(p.Value), rank: ss.rank}
	j.bytes += len(p.Key) + len(p.Value)
	j.written(p.Key)
	return &Ack{}, true
}

func (ss *session) get(g *Get) (Message, bool) {
	s := ss.srv
	if len(g.Keys) > s.cfg.MaxKeysPerJob {
		ss.log.Warn().Int("keys", len(g.Keys)).Msg("dropping client: get of too many keys")
		return &ErrorReply{Code: CodeLimit, Message: fmt.Sprintf("a get of %d keys is more than this server's limit of %d", len(g.Keys), s.cfg.MaxKeysPerJob)}, false
	}
	for _, k := range g.Keys {
		if r := checkKey(k); r != nil {
			ss.log.Warn().Str("error", r.Message).Msg("dropping client: bad key")
			return r, false
		}
	}
	wait := min(time.Duration(g.WaitMillis)*time.Millisecond, s.cfg.MaxWait)
	deadline := time.Now().Add(wait)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	var w *watcher
	defer func() { w.stop(ss.conn) }()
	j := ss.job
	// A get waits on one missing key at a time, the first one in its list,
	// and is woken only when that key is written: with every rank of a big
	// job waiting, a put does not wake them all to rescan every key.
	next := 0 // keys before next are known to be present
	var wake chan struct{}
	defer func() {
		s.mu.Lock()
		j.unwait(g.Keys, next, wake)
		s.mu.Unlock()
	}()
	for {
		s.mu.Lock()
		j.unwait(g.Keys, next, wake)
		wake = nil
		if j.failed != nil {
			s.mu.Unlock()
			return j.failed, true
		}
		for next < len(g.Keys) {
			if _, ok := j.values[g.Keys[next]]; !ok {
				break
			}
			next++
		}
		if next == len(g.Keys) {
			values, size := make([][]byte, len(g.Keys)), 0
			for i, k := range g.Keys {
				values[i] = j.values[k].value
				size += 4 + len(values[i])
			}
			s.mu.Unlock()
			if size > MaxFrameBytes-16 {
				return &ErrorReply{Code: CodeLimit, Message: fmt.Sprintf("the reply would be %d bytes, more than the protocol's limit", size)}, true
			}
			return &Values{Values: values}, true
		}
		if !time.Now().Before(deadline) {
			var missing []uint32
			for i := next; i < len(g.Keys); i++ {
				if _, ok := j.values[g.Keys[i]]; !ok {
					missing = append(missing, uint32(i))
				}
			}
			s.mu.Unlock()
			ss.log.Debug().Int("missing", len(missing)).Int("keys", len(g.Keys)).Msg("get timed out")
			return &ErrorReply{Code: CodeTimeout, Missing: missing,
				Message: fmt.Sprintf("%d of %d keys did not arrive within %s", len(missing), len(g.Keys), roundDuration(wait))}, true
		}
		wake = j.wait(g.Keys[next])
		s.mu.Unlock()

		if w == nil {
			ss.log.Debug().Int("keys", len(g.Keys)).Str("first_missing", g.Keys[next]).Dur("wait", wait).Msg("waiting for keys")
			if w = ss.watch(); w == nil {
				return &ErrorReply{Code: CodeShuttingDown, Message: "the server is shutting down"}, false
			}
		}
		select {
		case <-wake:
		case <-j.failedCh:
		case <-timer.C:
		case <-s.quit:
			// A job failed just before shutdown (the hosting rank gave
			// up) should be reported as such, not as a shutdown.
			s.mu.Lock()
			failed := j.failed
			s.mu.Unlock()
			if failed != nil {
				return failed, false
			}
			return &ErrorReply{Code: CodeShuttingDown, Message: "the server is shutting down"}, false
		case <-w.done:
			if errors.Is(w.err, os.ErrDeadlineExceeded) && s.isClosing() {
				// Shutdown's deadline woke the watcher.
				return &ErrorReply{Code: CodeShuttingDown, Message: "the server is shutting down"}, false
			}
			if w.err == nil {
				ss.log.Warn().Msg("dropping client: request sent while a get was pending")
				return badRequest("request sent while a get was pending"), false
			}
			ss.log.Debug().Err(w.err).Msg("client left while waiting")
			return nil, false
		}
	}
}

// watcher notices a client hanging up while its get is blocked: the client
// sends nothing in that time, so any outcome of a read means it is gone (or
// broke the protocol).
type watcher struct {
	done chan struct{}
	err  error
}

func (ss *session) watch() *watcher {
	s := ss.srv
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return nil
	}
	ss.conn.SetReadDeadline(time.Time{})
	s.mu.Unlock()
	w := &watcher{done: make(chan struct{})}
	go func() {
		_, w.err = ss.br.Peek(1)
		close(w.done)
	}()
	return w
}

// stop ends the watch; a byte it read stays buffered for the next request.
func (w *watcher) stop(c net.Conn) {
	if w == nil {
		return
	}
	c.SetReadDeadline(time.Unix(1, 0))
	<-w.done
}

func (ss *session) leave() (Message, bool) {
	s := ss.srv
	s.mu.Lock()
	defer s.mu.Unlock()
	j := ss.job
	ss.left = true
	j.left[ss.rank] = struct{}{}
	j.touched = time.Now()
	if len(j.left) == j.size {
		select {
		case <-j.done:
		default:
			close(j.done)
			if j != s.pinned && s.jobs[j.key] == j {
				delete(s.jobs, j.key)
			}
			ss.log.Info().Int("size", j.size).Dur("elapsed", time.Since(j.created)).Msg("job complete")
		}
	}
	return &Ack{}, true
}
