package rendezvous

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// DefaultTimeout is the deadline of a call whose ClientConfig.Timeout is zero
// and whose context has no earlier one.
const DefaultTimeout = 5 * time.Minute

// ClientConfig says who a rank is and where its rendezvous server is.
type ClientConfig struct {
	Addr    string // host:port of the server; DefaultAddr if empty
	Token   string
	Job     string // job id
	Attempt string // attempt id; "" allowed
	// Launch names the launch this rank belongs to: something every rank
	// of one launch, and no rank of another, was given (comm derives it
	// from the launcher's environment). Ranks of different launches never
	// meet, even under one job id and attempt. "" if unknown.
	Launch string
	Rank   int
	Size   int
	// Timeout is the overall deadline for the call, connection retries
	// included; DefaultTimeout if zero. A context deadline that comes
	// earlier wins.
	Timeout time.Duration
	// Logger receives debug lines about retries and, in HostAllgather, the
	// embedded server's log. The zero Logger discards them.
	Logger zerolog.Logger
}

const (
	// leaveTimeout bounds the courtesy leave after a successful get; the
	// caller already has its result.
	leaveTimeout = 2 * time.Second
	// dialTimeout bounds one connection attempt, so that a dropped SYN (a
	// server host still booting) is retried rather than waited out.
	dialTimeout = 10 * time.Second
	maxBackoff  = time.Second
	// replyGrace is how late past the deadline the server's answer to a
	// get may come: it names the missing ranks, which is worth the wait.
	replyGrace = 2 * time.Second
	// replyAhead is how large a reply the client allocates in one go, on
	// the server's word; larger ones grow as they arrive.
	replyAhead = 64 << 20
)

func payloadKey(rank int) string { return "payload/" + strconv.Itoa(rank) }

// call is one Allgather: its config, its deadline and its log.
type call struct {
	cfg      ClientConfig
	instance uint64 // this call's, kept across retries
	start    time.Time
	deadline time.Time
	keys     []string
	log      zerolog.Logger
	// stay keeps the connection open after the leave (Present), and
	// presence is that connection once the call has succeeded.
	stay     bool
	presence *Presence
}

func newCall(ctx context.Context, cfg ClientConfig, start time.Time) (*call, error) {
	c := &call{cfg: cfg, start: start, instance: rand.Uint64()}
	if c.cfg.Addr == "" {
		c.cfg.Addr = DefaultAddr
	}
	var msg string
	switch {
	case cfg.Job == "" || len(cfg.Job) > maxJobLen:
		msg = fmt.Sprintf("job id must be 1 to %d bytes long", maxJobLen)
	case len(cfg.Attempt) > maxAttemptLen:
		msg = fmt.Sprintf("attempt id must be at most %d bytes long", maxAttemptLen)
	case len(cfg.Launch) > maxLaunchLen:
		msg = fmt.Sprintf("launch id must be at most %d bytes long", maxLaunchLen)
	case len(cfg.Token) > maxTokenLen:
		msg = fmt.Sprintf("token must be at most %d bytes long", maxTokenLen)
	case cfg.Size < 1 || int64(cfg.Size) > math.MaxUint32:
		msg = fmt.Sprintf("job size %d is out of range", cfg.Size)
	case cfg.Rank < 0 || cfg.Rank >= cfg.Size:
		msg = fmt.Sprintf("rank %d is out of range for a job of %d ranks", cfg.Rank, cfg.Size)
	case cfg.Timeout < 0:
		msg = fmt.Sprintf("negative timeout %s", cfg.Timeout)
	}
	if msg != "" {
		return nil, c.errorf(CodeBadRequest, nil, "%s", msg)
	}
	timeout := cfg.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	c.deadline = start.Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(c.deadline) {
		c.deadline = d
	}
	c.keys = make([]string, cfg.Size)
	for r := range c.keys {
		c.keys[r] = payloadKey(r)
	}
	c.log = cfg.Logger.With().Str("job", cfg.Job).Str("attempt", cfg.Attempt).Str("launch", cfg.Launch).Int("rank", cfg.Rank).Logger()
	return c, nil
}

func (c *call) errorf(code Code, cause error, format string, args ...any) *Error {
	return &Error{Code: code, Job: c.cfg.Job, Attempt: c.cfg.Attempt, Size: c.cfg.Size, Msg: fmt.Sprintf(format, args...), Err: cause}
}

func (c *call) budget() time.Duration { return roundDuration(c.deadline.Sub(c.start)) }

// Allgather contributes payload as rank cfg.Rank and returns the payloads of
// all cfg.Size ranks, in rank order (its own included). It retries
// connecting until the deadline, since the server may not be up yet, and
// starts over on a new connection if one breaks. Errors are *Error.
func Allgather(ctx context.Context, cfg ClientConfig, payload []byte) ([][]byte, error) {
	c, err := newCall(ctx, cfg, time.Now())
	if err != nil {
		return nil, err
	}
	return c.allgather(ctx, payload)
}

// Present is Allgather for a rank that stays in the job while it runs: the
// connection to the server is kept open after the result until Close, so
// that a shared server sees the job alive. While it is, the server refuses
// any rank that arrives under the job's name, and tells the ranks present
// that their job may have met another run's ranks (Presence.Done, Err).
func Present(ctx context.Context, cfg ClientConfig, payload []byte) ([][]byte, *Presence, error) {
	c, err := newCall(ctx, cfg, time.Now())
	if err != nil {
		return nil, nil, err
	}
	c.stay = true
	values, err := c.allgather(ctx, payload)
	if err != nil {
		return nil, nil, err
	}
	p := c.presence
	if p == nil { // the server hung up at once
		p = &Presence{done: make(chan struct{})}
		close(p.done)
		return values, p, nil
	}
	go p.watch(c)
	return values, p, nil
}

// Presence is a rank's open connection to the rendezvous after Present.
type Presence struct {
	conn net.Conn
	br   *bufio.Reader
	done chan struct{}
	err  error // written before done is closed
	once sync.Once
}

// Done is closed when the connection ends: the server's notice came (Err),
// the server went away, or Close was called.
func (p *Presence) Done() <-chan struct{} { return p.done }

// Err is the server's notice once Done is closed: an *Error (CodeDuplicate:
// a rank of another run arrived under this job's name), or nil when the
// connection just ended.
func (p *Presence) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// Close hangs up and waits for the watch to end; safe to call twice.
func (p *Presence) Close() error {
	p.once.Do(func() {
		if p.conn != nil {
			p.conn.Close()
		}
	})
	<-p.done
	return nil
}

// watch waits for the server's one notice, or for the connection to end.
func (p *Presence) watch(c *call) {
	defer close(p.done)
	defer p.once.Do(func() { p.conn.Close() })
	body, err := readFrame(p.br, 64<<10, 64<<10)
	if err != nil {
		return
	}
	m, err := Decode(body)
	if err != nil {
		return
	}
	if r, ok := m.(*ErrorReply); ok {
		p.err = c.fromReply(r)
		c.log.Warn().Err(p.err).Msg("the rendezvous server failed the job while it runs")
	}
}

func (c *call) allgather(ctx context.Context, payload []byte) ([][]byte, error) {
	backoff := 10 * time.Millisecond
	var last error
	var otherJob *Error // the last "another job's server" answer
	reached := false
	for {
		values, connected, err := c.once(ctx, payload)
		reached = reached || connected
		if err == nil {
			return values, nil
		}
		if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return nil, c.errorf(0, ctx.Err(), "rank %d gave up after %s", c.cfg.Rank, roundDuration(time.Since(c.start)))
		}
		var e *Error
		if errors.As(err, &e) && !e.Code.retryable() {
			return nil, e
		}
		var ne net.Error
		switch {
		case errors.As(err, &e) && e.Code == CodeOtherJob:
			otherJob = e
		case errors.As(err, &ne) && ne.Timeout() && !time.Now().Before(c.deadline):
			// Cut off by our own deadline: that says nothing new about
			// who serves the address.
		default:
			otherJob = nil
		}
		last = err
		sleep := backoff/2 + rand.N(backoff/2+1)
		if time.Until(c.deadline) < sleep || ctx.Err() != nil {
			break
		}
		c.log.Debug().Err(err).Str("server", c.cfg.Addr).Dur("retry_in", sleep).Msg("rendezvous server not ready, retrying")
		t := time.NewTimer(sleep)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		backoff = min(2*backoff, maxBackoff)
	}
	if otherJob != nil {
		// Another job's rank 0 still holds the address: our own rank 0
		// never got it (or is not ours to wait for).
		return nil, c.errorf(CodeOtherJob, nil, "the server at %s still served another job after %s: %s", c.cfg.Addr, c.budget(), otherJob.Msg)
	}
	if reached {
		return nil, c.errorf(CodeTimeout, last, "no complete exchange with the server at %s within %s", c.cfg.Addr, c.budget())
	}
	return nil, c.errorf(CodeTimeout, last, "could not reach the server at %s within %s", c.cfg.Addr, c.budget())
}

// once runs the whole exchange on one connection: hello, put, get, leave.
// connected reports whether the server answered the hello.
func (c *call) once(ctx context.Context, payload []byte) (values [][]byte, connected bool, err error) {
	d := net.Dialer{Deadline: c.deadline, Timeout: dialTimeout}
	conn, err := d.DialContext(ctx, "tcp", c.cfg.Addr)
	if err != nil {
		return nil, false, err
	}
	kept := false
	defer func() {
		if !kept {
			conn.Close()
		}
	}()
	// Cancelling ctx unblocks whatever read or write is under way; a
	// deadline set later must not undo that.
	setDeadline := func(t time.Time) {
		conn.SetDeadline(t)
		if ctx.Err() != nil {
			conn.SetDeadline(time.Unix(1, 0))
		}
	}
	setDeadline(c.deadline)
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	cc := clientConn{call: c, conn: conn, br: bufio.NewReader(conn)}

	if _, err := cc.roundTrip(c.hello(), TypeAck); err != nil {
		return nil, false, err
	}
	if _, err := cc.roundTrip(&Put{Key: payloadKey(c.cfg.Rank), Value: payload}, TypeAck); err != nil {
		return nil, true, err
	}
	// Ask the server to give up a little before our own deadline, and
	// allow its answer, which names the missing ranks, to come a little
	// after it on a busy machine.
	setDeadline(c.deadline.Add(replyGrace))
	for {
		sent := time.Now()
		left := c.deadline.Sub(sent)
		wait := left - min(left/20, 100*time.Millisecond)
		reply, err := cc.roundTrip(&Get{WaitMillis: millis(wait), Keys: c.keys}, TypeValues)
		var e *Error
		if errors.As(err, &e) && e.Code == CodeTimeout && time.Now().Before(sent.Add(wait-50*time.Millisecond)) {
			continue // the server caps waits below ours: ask again
		}
		if err != nil {
			return nil, true, err
		}
		values = reply.(*Values).Values
		if len(values) != c.cfg.Size {
			return nil, true, c.errorf(CodeBadRequest, nil, "the server at %s sent %d values for %d keys", c.cfg.Addr, len(values), c.cfg.Size)
		}
		break
	}
	// Tell the server we have the result: the hosting rank waits for
	// everybody's leave before it closes its server.
	setDeadline(time.Now().Add(leaveTimeout))
	if _, err := cc.roundTrip(&Leave{}, TypeAck); err != nil {
		c.log.Debug().Err(err).Msg("leave failed")
	} else if c.stay {
		stop()
		conn.SetDeadline(time.Time{})
		kept = true
		c.presence = &Presence{conn: conn, br: cc.br, done: make(chan struct{})}
	}
	// The values alias frame buffers that are ours alone: no copy needed.
	return values, true, nil
}

func (c *call) hello() *Hello {
	return &Hello{
		Version:  ProtocolVersion,
		Token:    c.cfg.Token,
		Job:      c.cfg.Job,
		Attempt:  c.cfg.Attempt,
		Launch:   c.cfg.Launch,
		Instance: c.instance,
		Rank:     uint32(c.cfg.Rank),
		Size:     uint32(c.cfg.Size),
	}
}

func millis(d time.Duration) uint32 {
	if d <= 0 {
		return 0
	}
	return uint32(min(d.Milliseconds(), math.MaxUint32))
}

type clientConn struct {
	*call
	conn net.Conn
	br   *bufio.Reader
}

// roundTrip sends m and reads its reply; an ErrorReply comes back as *Error.
func (cc *clientConn) roundTrip(m Message, want MsgType) (Message, error) {
	if _, err := cc.conn.Write(AppendFrame(nil, m)); err != nil {
		return nil, err
	}
	body, err := readFrame(cc.br, MaxFrameBytes, replyAhead)
	if err != nil {
		return nil, err
	}
	reply, err := Decode(body)
	if err != nil {
		return nil, cc.errorf(CodeBadRequest, err, "bad reply from the server at %s", cc.cfg.Addr)
	}
	if r, ok := reply.(*ErrorReply); ok {
		return nil, cc.fromReply(r)
	}
	if reply.Type() != want {
		return nil, cc.errorf(CodeBadRequest, nil, "the server at %s answered %s with %s", cc.cfg.Addr, m.Type(), reply.Type())
	}
	return reply, nil
}

// fromReply turns the server's error into one that speaks of ranks.
func (c *call) fromReply(r *ErrorReply) *Error {
	switch r.Code {
	case CodeUnauthorized:
		if r.Message != tokenRejected {
			return c.errorf(r.Code, nil, "the server at %s refused this rank: %s", c.cfg.Addr, r.Message)
		}
		return c.errorf(r.Code, nil, "the server at %s rejected the token", c.cfg.Addr)
	case CodeTimeout:
		// Keys are payloadKey(0..Size-1), so a key's position is its rank.
		var missing []int
		for _, i := range r.Missing {
			if int64(i) < int64(c.cfg.Size) {
				missing = append(missing, int(i))
			}
		}
		e := c.errorf(r.Code, nil, "%s of %d did not arrive within %s", rankList(missing), c.cfg.Size, c.budget())
		e.Missing = missing
		return e
	case CodeMismatch, CodeAborted, CodeDuplicate, CodeOtherJob:
		return c.errorf(r.Code, nil, "%s", r.Message)
	}
	return c.errorf(r.Code, nil, "the server at %s: %s", c.cfg.Addr, r.Message)
}
