package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"
)

// hostLinger is how long, at least, the hosting rank keeps serving after it
// has its own result, for the others to collect theirs.
const hostLinger = 10 * time.Second

// shutdownGrace bounds how long the hosting rank waits for its connections
// to wind down when it closes its server.
const shutdownGrace = time.Second

// HostAllgather is Allgather for the rank that hosts the job's rendezvous
// (rank 0 by default): it serves cfg's job, and only that job, on listenAddr
// (cfg.Addr if empty), takes part in the allgather through its own server
// like every other rank, and keeps serving until every rank has collected
// the result, or until the deadline (and at least a few seconds after its
// own result), then closes the server.
//
// Without cfg.Token the server only listens on a loopback address. If this
// rank's allgather fails, the ranks still waiting are told why at once
// rather than left to time out.
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
	key := jobKey{cfg.Job, cfg.Attempt}
	j := newJob(key, cfg.Size, cfg.Rank, c.start)
	j.refs = 1 // pinned: never collected
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
	l, err := net.Listen("tcp", listenAddr)
	if err != nil {
		return nil, c.errorf(0, err, "cannot host the rendezvous")
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

	own := *c
	own.cfg.Addr = dialAddr(l.Addr())
	values, err := own.allgather(ctx, payload)
	if err != nil {
		srv.abort(fmt.Sprintf("the hosting rank %d gave up: %s", cfg.Rank, detail(err)))
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
	case <-linger.C:
	case <-ctx.Done():
	}
	srv.mu.Lock()
	missing := j.notLeft()
	srv.mu.Unlock()
	if len(missing) == 0 { // the last leave raced the timer
		return values, nil
	}
	var e *Error
	if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		e = c.errorf(0, ctx.Err(), "the host stopped serving before %s of %d collected the result", rankList(missing), cfg.Size)
	} else {
		e = c.errorf(CodeTimeout, nil, "%s of %d did not collect the result within %s", rankList(missing), cfg.Size, roundDuration(lingerEnd.Sub(c.start)))
	}
	e.Missing = missing
	srv.abort(fmt.Sprintf("the hosting rank %d gave up: %s", cfg.Rank, e.Msg))
	return nil, e
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
