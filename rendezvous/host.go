package rendezvous

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"syscall"
	"time"
)

// hostLinger is how long, at least, the hosting rank keeps serving after it
// has its own result, for the others to collect theirs.
const hostLinger = 10 * time.Second

// shutdownGrace bounds how long the hosting rank waits for its connections
// to wind down when it closes its server.
const shutdownGrace = time.Second

// goneGrace is how long a rank may be without a connection, before it has
// left, until the hosting rank takes its process for dead. A client whose
// connection breaks reconnects within milliseconds.
const goneGrace = time.Second

// probeTimeout bounds the hosting rank's look at whoever holds its address.
const probeTimeout = 2 * time.Second

// Errors the hosting rank's *Error wraps (in Err) when it cannot host, so
// that callers can say what to change.
var (
	// ErrAddressInUse: the listen address stayed taken until the deadline.
	ErrAddressInUse = errors.New("address in use")
	// ErrSharedServer: a shared server (halod serve), not an embedded
	// rendezvous, answers at the listen address.
	ErrSharedServer = errors.New("a shared rendezvous server answers there")
)

// HostAllgather is Allgather for the rank that hosts the job's rendezvous
// (rank 0 by default): it serves cfg's job, and only that job, on listenAddr
// (cfg.Addr if empty), takes part in the allgather through its own server
// like every other rank, and keeps serving until every rank has collected
// the result, or until the deadline (and at least a few seconds after its
// own result), then closes the server.
//
// Without cfg.Token the server only listens on a loopback address, and takes
// only processes of its own user (on Linux). If the address is in use,
// HostAllgather waits for it until the deadline: another job's rank 0 frees
// it when its job has met. It never joins a rendezvous it does not host.
//
// If the job fails (ranks disagree, a rank went away, the deadline passed),
// every rank that arrives before the deadline is told why, rather than left
// to time out: the server stays up until all of them have been told.
func HostAllgather(ctx context.Context, listenAddr string, cfg ClientConfig, payload []byte) ([][]byte, error) {
	return hostAllgather(ctx, listenAddr, cfg, payload, hostLinger)
}

func hostAllgather(ctx context.Context, listenAddr string, cfg ClientConfig, payload []byte, minLinger time.Duration) ([][]byte, error) {
	c, err := newCall(ctx, cfg, time.Now())
	if err != nil {
		return nil, err
	}
	if listenAddr == "" {
		listenAddr = c.cfg.Addr
	}
	srv, err := NewServer(ServerConfig{Token: cfg.Token, Insecure: cfg.Token == "", Logger: cfg.Logger})
	if err != nil {
		return nil, c.errorf(CodeBadRequest, err, "cannot host")
	}
	key := jobKey{cfg.Job, cfg.Attempt, cfg.Launch}
	j := newJob(key, cfg.Size, cfg.Rank, c.start)
	j.refs = 1 // pinned: never collected
	// This process holds its rank for as long as it serves, so that a
	// second process claiming it is found out at once.
	j.claims[cfg.Rank] = &claim{instance: c.instance, remote: "the hosting process", live: 1}
	srv.pinned = j
	srv.jobs[key] = j

	if _, _, err := net.SplitHostPort(listenAddr); err != nil {
		return nil, c.errorf(CodeBadRequest, err, "cannot host the rendezvous")
	}
	refuse := func(addr string) error {
		return c.errorf(CodeBadRequest, nil, "refusing to host the rendezvous on %s without a token: set one, or host on a loopback address", addr)
	}
	if srv.checkListenAddr(listenAddr) != nil {
		return nil, refuse(listenAddr)
	}
	l, err := c.listen(ctx, listenAddr)
	if err != nil {
		return nil, err
	}
	if srv.checkAddr(l.Addr()) != nil {
		l.Close()
		return nil, refuse(l.Addr().String())
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		srv.Shutdown(sctx)
		if err := <-served; err != nil && !errors.Is(err, ErrServerClosed) {
			c.log.Warn().Err(err).Msg("rendezvous server failed")
		}
	}()
	stopWatch := make(chan struct{})
	defer close(stopWatch)
	go c.watchGone(srv, j, stopWatch)

	own := *c
	own.cfg.Addr = dialAddr(l.Addr())
	values, err := own.allgather(ctx, payload)
	if err != nil {
		srv.abort(fmt.Sprintf("the hosting rank %d gave up: %s", cfg.Rank, detail(err)))
		c.tellEveryone(ctx, srv, j)
		return nil, err
	}

	lingerEnd := c.deadline
	if t := time.Now().Add(minLinger); t.After(lingerEnd) {
		lingerEnd = t
	}
	linger := time.NewTimer(time.Until(lingerEnd))
	defer linger.Stop()
	select {
	case <-j.done:
		return values, nil
	case <-j.failedCh:
		// watchGone failed the job: a rank went away without its result.
		srv.mu.Lock()
		msg := j.failed.Message
		missing := j.notLeft()
		srv.mu.Unlock()
		c.tellEveryone(ctx, srv, j)
		e := c.errorf(CodeAborted, nil, "%s", msg)
		e.Missing = missing
		return nil, e
	case <-linger.C:
	case <-ctx.Done():
	}
	srv.mu.Lock()
	missing := j.notLeft()
	srv.mu.Unlock()
	if len(missing) == 0 { // the last leave raced the timer
		return values, nil
	}
	took := roundDuration(time.Since(c.start))
	var e *Error
	if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		e = c.errorf(0, ctx.Err(), "the host stopped serving after %s, before %s of %d collected the result", took, rankList(missing), cfg.Size)
	} else {
		e = c.errorf(CodeTimeout, nil, "%s of %d did not collect the result within %s", rankList(missing), cfg.Size, took)
	}
	e.Missing = missing
	srv.abort(fmt.Sprintf("the hosting rank %d gave up: %s", cfg.Rank, e.Msg))
	return nil, e
}

// listen listens on addr, waiting while another job's rendezvous holds it.
func (c *call) listen(ctx context.Context, addr string) (net.Listener, error) {
	backoff := 20 * time.Millisecond
	var holder string
	for {
		l, err := net.Listen("tcp", addr)
		if err == nil {
			return l, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) {
			return nil, c.errorf(0, err, "rank %d cannot host the rendezvous", c.cfg.Rank)
		}
		// Who holds it? Our own job's rendezvous means this process is a
		// second rank 0; a shared server is not ours to join.
		h, final := c.probe(ctx, addr)
		if final != nil {
			return nil, final
		}
		if h != "" {
			holder = h
		}
		sleep := backoff/2 + rand.N(backoff/2+1)
		if time.Until(c.deadline) < sleep || ctx.Err() != nil {
			if holder == "" {
				holder = "something that is not a rendezvous of this version"
			}
			e := c.errorf(CodeTimeout, ErrAddressInUse, "rank %d could not host the rendezvous: %s was still in use after %s (held by %s)",
				c.cfg.Rank, addr, c.budget(), holder)
			return nil, e
		}
		c.log.Debug().Str("addr", addr).Str("holder", holder).Dur("retry_in", sleep).Msg("rendezvous address in use, waiting")
		t := time.NewTimer(sleep)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// probe says hello, as this rank, to whoever listens on addr. It returns a
// description of the holder, or a final error when waiting cannot help.
func (c *call) probe(ctx context.Context, addr string) (holder string, final error) {
	d := net.Dialer{Timeout: probeTimeout}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", nil // gone already, or unreachable: try listening again
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(probeTimeout))
	if _, err := conn.Write(AppendFrame(nil, c.hello())); err != nil {
		return "", nil
	}
	body, err := readFrame(bufio.NewReader(conn), 64<<10, 64<<10)
	if err != nil {
		return "", nil
	}
	reply, err := Decode(body)
	if err != nil {
		return "", nil
	}
	switch r := reply.(type) {
	case *Ack:
		return "", c.errorf(CodeBadRequest, ErrSharedServer, "rank %d cannot host the rendezvous on %s: a shared rendezvous server listens there and took this job", c.cfg.Rank, addr)
	case *ErrorReply:
		switch r.Code {
		case CodeDuplicate:
			// Our job's own rendezvous: another process hosts it as
			// this rank, and has now failed the job on every rank.
			return "", c.errorf(CodeDuplicate, nil, "%s", r.Message)
		case CodeOtherJob:
			return "the rendezvous of another job: " + r.Message, nil
		case CodeUnauthorized:
			return "a rendezvous with another token", nil
		case CodeVersion:
			return "a rendezvous of another halo version", nil
		}
		return "a rendezvous that answered: " + r.Message, nil
	}
	return "", nil
}

// watchGone fails the job when a rank's process has gone away before
// leaving: nobody would tell the others otherwise until the deadline.
func (c *call) watchGone(srv *Server, j *job, stop <-chan struct{}) {
	tick := time.NewTicker(goneGrace / 4)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-j.done:
			return
		case <-j.failedCh:
			return
		case <-tick.C:
		}
		srv.mu.Lock()
		gone, since := j.goneRanks(time.Now(), goneGrace)
		if len(gone) > 0 {
			j.fail(CodeAborted, fmt.Sprintf("%s of %d disconnected %s into the rendezvous without confirming the result (its process ended, or it gave up waiting)",
				rankList(gone), c.cfg.Size, roundDuration(since.Sub(c.start))))
		}
		srv.mu.Unlock()
	}
}

// tellEveryone keeps the server up, after the job failed, until every rank
// that is still alive has been told why, or until the deadline: a rank that
// arrives late would otherwise find nobody listening and report only that
// it could not connect.
func (c *call) tellEveryone(ctx context.Context, srv *Server, j *job) {
	deadline := time.NewTimer(time.Until(c.deadline))
	defer deadline.Stop()
	for {
		srv.mu.Lock()
		waiting := 0
		for _, r := range j.untold() {
			if cl := j.claims[r]; cl == nil || cl.live > 0 || cl.gone.IsZero() {
				waiting++ // not known to be dead
			}
		}
		srv.mu.Unlock()
		if waiting == 0 {
			return
		}
		select {
		case <-j.events:
		case <-deadline.C:
			return
		case <-ctx.Done():
			return
		}
	}
}

// abort fails the pinned job, so that every rank still waiting learns why.
func (s *Server) abort(msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pinned.fail(CodeAborted, msg)
}

// detail is an error's message without the job prefix, for relaying.
func detail(err error) string {
	var e *Error
	if errors.As(err, &e) {
		if e.Err != nil {
			return e.Msg + ": " + e.Err.Error()
		}
		return e.Msg
	}
	return err.Error()
}

// dialAddr turns a listening address into one this process can connect to:
// a wildcard listener (dual-stack in Go) is reached over IPv4 loopback.
func dialAddr(a net.Addr) string {
	tcp, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	ip := tcp.IP
	if ip.IsUnspecified() {
		ip = net.IPv4(127, 0, 0, 1)
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(tcp.Port))
}
