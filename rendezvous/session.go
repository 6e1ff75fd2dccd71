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
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// session serves one client connection, one request at a time.
type session struct {
	srv      *Server
	conn     net.Conn
	br       *bufio.Reader
	log      zerolog.Logger
	job      *job
	rank     int
	instance uint64
	left     bool
	evicted  bool // closed by admit to make room; guarded by the server's mutex
}

func (ss *session) serve() {
	s := ss.srv
	defer func() {
		ss.conn.Close()
		s.mu.Lock()
		delete(s.sessions, ss)
		delete(s.pending, ss)
		if j := ss.job; j != nil {
			s.authed--
			j.refs--
			j.touched = time.Now()
			if c := j.claims[ss.rank]; c != nil && c.instance == ss.instance {
				if c.live--; c.live == 0 && !c.left && !ss.left {
					j.rankGone(ss.rank, j.touched)
					ss.log.Debug().Msg("rank went away before leaving")
				}
			}
			delete(j.present, ss)
			// A complete job is forgotten once its last rank hangs up: the
			// next run under the same id starts afresh. One that failed
			// stays a while (jobForLocked), to tell latecomers why.
			if j.refs == 0 && j.complete() && j.failed == nil && j != s.pinned && s.jobs[j.key] == j {
				delete(s.jobs, j.key)
				ss.log.Info().Int("size", j.size).Dur("elapsed", time.Since(j.created)).Msg("job ended")
			}
		}
		s.mu.Unlock()
		s.wg.Done()
	}()
	ss.log.Debug().Msg("client connected")
	if !ss.sameUser() {
		return
	}
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
	if ss.left {
		// A rank that has left sends nothing more, but may keep its
		// connection for as long as it runs (see leave): no idle limit.
		ss.conn.SetReadDeadline(time.Time{})
		return true
	}
	wait := s.cfg.IdleTimeout
	if ss.job == nil {
		wait = min(wait, s.cfg.HelloTimeout)
	}
	ss.conn.SetReadDeadline(time.Now().Add(wait))
	return true
}

// lookupPeerUID is peerUID; tests stand in for another user.
var lookupPeerUID = peerUID

// sameUser enforces, on a server without a token (which serves loopback
// only), that the client runs as the server's user: other users on the
// host must not join, or poison, a job. It answers and returns false when
// the client is someone else.
func (ss *session) sameUser() bool {
	if ss.srv.cfg.Token != "" {
		return true
	}
	uid, err := lookupPeerUID(ss.conn)
	if errors.Is(err, errUIDUnsupported) {
		return true
	}
	var msg string
	switch {
	case err != nil:
		msg = fmt.Sprintf("this rendezvous has no token and takes only its own user's processes, but the owner of %s is unknown: %v", ss.conn.RemoteAddr(), err)
	case uid != os.Getuid():
		msg = fmt.Sprintf("this rendezvous has no token and takes only its own user's processes (uid %d), not uid %d", os.Getuid(), uid)
	default:
		return true
	}
	ss.drop(CodeUnauthorized, msg, "rejecting client: another user")
	return false
}

func (ss *session) readFailed(err error) {
	closing := ss.srv.isClosing()
	ss.srv.mu.Lock()
	evicted := ss.evicted
	ss.srv.mu.Unlock()
	switch {
	case evicted:
	case err == io.EOF:
		ss.log.Debug().Msg("client disconnected")
	case closing:
		ss.log.Debug().Err(err).Msg("closing connection: server shutting down")
	case errors.Is(err, os.ErrDeadlineExceeded) && ss.job == nil:
		ss.log.Warn().Bool("before_hello", true).Dur("hello_timeout", min(ss.srv.cfg.HelloTimeout, ss.srv.cfg.IdleTimeout)).Msg("dropping stalled client")
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
	if r, ok := m.(*ErrorReply); ok && ss.job != nil {
		s := ss.srv
		s.mu.Lock()
		if r == ss.job.failed {
			ss.job.tell(ss.rank)
		}
		s.mu.Unlock()
	}
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

// tokenRejected is the server's word for a wrong token.
const tokenRejected = "the server rejected the token"

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
		return &ErrorReply{Code: CodeUnauthorized, Message: tokenRejected}, false
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
	log := ss.log.With().Str("job", h.Job).Str("attempt", h.Attempt).Str("launch", h.Launch).Int("rank", rank).Logger()
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	j, r := s.jobForLocked(h, now)
	if r != nil {
		log.Warn().Str("error", r.Message).Msg("rejecting client")
		return r, false
	}
	j.maxSize = max(j.maxSize, min(size, s.cfg.MaxKeysPerJob))
	if j.complete() {
		// Every rank has its result and some still hold their connection
		// (or the job failed so a moment ago): this one belongs to another
		// run under the same name, and so, it may be, do some of the ranks
		// that met. Fail them too.
		msg := fmt.Sprintf("rank %d of %s arrived from %s after the job's %d ranks had met, while they still run: "+
			"two runs share this job id and attempt, so the ranks that met may belong to different runs", rank, j.key.describe(), ss.conn.RemoteAddr(), j.size)
		log.Warn().Int("present", len(j.present)).Msg("refusing client: its job is complete and still running")
		if j.failed == nil {
			notice := j.fail(CodeDuplicate, msg)
			for p := range j.present {
				s.wg.Add(1)
				go func() { // write takes the lock
					defer s.wg.Done()
					p.write(notice)
				}()
			}
		}
		return &ErrorReply{Code: CodeDuplicate, Message: msg}, false
	}
	switch {
	case j.failed != nil:
	case size != j.size:
		j.fail(CodeMismatch, fmt.Sprintf("rank %d says the job has %d ranks, but rank %d said %d", rank, size, j.sizeFrom, j.size))
		log.Warn().Int("size", size).Int("expected_size", j.size).Msg("job failed: ranks disagree on its size")
	case rank >= size:
		j.fail(CodeMismatch, fmt.Sprintf("rank %d is out of range for a job of %d ranks", rank, size))
		log.Warn().Int("size", size).Msg("job failed: rank out of range")
	}
	if j.failed != nil {
		j.tell(rank)
		return j.failed, false
	}
	if s.authed >= s.cfg.MaxConns {
		log.Warn().Int("max_conns", s.cfg.MaxConns).Msg("rejecting client: connection limit reached")
		return &ErrorReply{Code: CodeBusy, Message: fmt.Sprintf("server is at its limit of %d connections", s.cfg.MaxConns)}, false
	}
	c := j.claims[rank]
	switch {
	case c == nil || c.instance == h.Instance:
		// The first claim, or the same process again (a retry).
	case c.live > 0 || c.left:
		log.Warn().Str("first_remote", c.remote).Msg("job failed: a rank claimed by two processes")
		// The holder is told when it next asks; it, not this newcomer,
		// is the rank the hosting rank waits to tell.
		return j.fail(CodeDuplicate, fmt.Sprintf("rank %d of %s was claimed by two processes (connected from %s and %s): two runs share this job id and attempt",
			rank, j.key.describe(), c.remote, ss.conn.RemoteAddr())), false
	default:
		// Its holder went away before leaving: this is that rank
		// restarted, and what the holder wrote is no longer current.
		log.Info().Msg("rank rejoins from a new process")
		c = nil
	}
	if c == nil {
		c = &claim{instance: h.Instance, remote: ss.conn.RemoteAddr().String()}
		j.claims[rank] = c
	}
	c.live++
	c.gone = time.Time{}
	j.refs++
	j.touched = now
	ss.job, ss.rank, ss.instance, ss.log = j, rank, h.Instance, log
	delete(s.pending, ss)
	s.authed++
	ss.log.Debug().Int("size", size).Msg("client joined")
	return &Ack{}, true
}

func checkKey(k string) *ErrorReply {
	if k == "" || len(k) > maxKeyLen {
		return badRequest("key must be 1 to %d bytes long, got %d", maxKeyLen, len(k))
	}
	return nil
}

// ownKey reports whether key is one that rank may write: its last
// path element is the rank, in decimal ("payload/3" for rank 3).
func ownKey(key string, rank int) bool {
	return strings.HasSuffix(key, "/"+strconv.Itoa(rank))
}

func (ss *session) put(p *Put) (Message, bool) {
	s := ss.srv
	if r := checkKey(p.Key); r != nil {
		ss.log.Warn().Str("error", r.Message).Msg("dropping client: bad key")
		return r, false
	}
	if !ownKey(p.Key, ss.rank) {
		r := badRequest("rank %d may write only its own keys (ending in /%d), not %q", ss.rank, ss.rank, p.Key)
		ss.log.Warn().Str("key", p.Key).Msg("dropping client: write to another rank's key")
		return r, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	j := ss.job
	j.touched = time.Now()
	if j.failed != nil {
		return j.failed, true
	}
	if old, ok := j.values[p.Key]; ok && old.instance != ss.instance && !j.current(p.Key) {
		// Written by this rank's previous process, which went away: the
		// restarted one's value replaces it.
		delete(j.values, p.Key)
		j.bytes -= len(p.Key) + len(old.value)
	}
	if old, ok := j.values[p.Key]; ok {
		if bytes.Equal(old.value, p.Value) {
			return &Ack{}, true // a retry
		}
		ss.log.Warn().Str("key", p.Key).Int("first_rank", old.rank).Msg("job failed: two different values for one key")
		return j.fail(CodeMismatch, fmt.Sprintf(
			"rank %d wrote key %q twice, with different values", ss.rank, p.Key)), true
	}
	if len(j.values) >= s.cfg.MaxKeysPerJob {
		ss.log.Warn().Int("max_keys", s.cfg.MaxKeysPerJob).Msg("job failed: key limit reached")
		return j.fail(CodeLimit, fmt.Sprintf("the job would store more than %d keys, this server's limit", s.cfg.MaxKeysPerJob)), true
	}
	if n := len(p.Key) + len(p.Value); j.bytes+n > s.cfg.MaxJobBytes {
		ss.log.Warn().Int("max_job_bytes", s.cfg.MaxJobBytes).Msg("job failed: byte limit reached")
		return j.fail(CodeLimit, fmt.Sprintf("the job would store more than %d bytes, this server's limit", s.cfg.MaxJobBytes)), true
	}
	j.values[p.Key] = entry{value: bytes.Clone(p.Value), rank: ss.rank, instance: ss.instance}
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
		for next < len(g.Keys) && j.current(g.Keys[next]) {
			next++
		}
		var values [][]byte
		size := 0
		if next == len(g.Keys) {
			values = make([][]byte, len(g.Keys))
			for i, k := range g.Keys {
				if !j.current(k) { // its writer went away since
					next = i
					break
				}
				values[i] = j.values[k].value
				size += 4 + len(values[i])
			}
		}
		if next == len(g.Keys) {
			s.mu.Unlock()
			if size > MaxFrameBytes-16 {
				return &ErrorReply{Code: CodeLimit, Message: fmt.Sprintf("the reply would be %d bytes, more than the protocol's limit", size)}, true
			}
			return &Values{Values: values}, true
		}
		if !time.Now().Before(deadline) {
			// Missing are the keys nobody wrote; failing those, the ones
			// whose writers went away.
			var missing []uint32
			for i := range g.Keys {
				if _, ok := j.values[g.Keys[i]]; !ok {
					missing = append(missing, uint32(i))
				}
			}
			if len(missing) == 0 {
				for i := range g.Keys {
					if !j.current(g.Keys[i]) {
						missing = append(missing, uint32(i))
					}
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

// leave records that the rank has its result. Its connection may stay open
// afterwards for as long as the rank runs (Present): that is how the server
// knows the job is alive, so that a latecomer under its name is refused and
// the ranks present are told.
func (ss *session) leave() (Message, bool) {
	s := ss.srv
	s.mu.Lock()
	defer s.mu.Unlock()
	j := ss.job
	ss.left = true
	j.left[ss.rank] = struct{}{}
	j.present[ss] = struct{}{}
	if c := j.claims[ss.rank]; c != nil && c.instance == ss.instance {
		c.left = true
	}
	j.touched = time.Now()
	if len(j.left) == j.size {
		select {
		case <-j.done:
		default:
			close(j.done) // the job is forgotten when its last connection closes (serve)
			ss.log.Info().Int("size", j.size).Dur("elapsed", time.Since(j.created)).Msg("job complete")
		}
	}
	return &Ack{}, true
}
