package rendezvous

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// DefaultAddr is where a server listens, and a client connects, when given
// no address: loopback only, so that nothing is exposed by accident.
const DefaultAddr = "127.0.0.1:29700"

// Defaults for the zero fields of ServerConfig.
const (
	DefaultMaxMessageBytes = 1 << 20
	DefaultMaxKeysPerJob   = 16384
	DefaultMaxJobBytes     = 64 << 20
	DefaultMaxJobs         = 1024
	DefaultMaxConns        = 4096
	DefaultIdleTimeout     = 30 * time.Second
	DefaultMaxWait         = time.Hour
	DefaultJobTTL          = 10 * time.Minute
	// DefaultHelloTimeout: a client says hello within milliseconds of
	// connecting; a connection that has not within seconds never will.
	DefaultHelloTimeout = 5 * time.Second
	// DefaultMaxUnauthenticated is how many connections may wait for
	// their hello at once. They do not count against MaxConns; past this
	// many, the oldest is closed to make room.
	DefaultMaxUnauthenticated = 64
)

// failedJobGrace is how long a failed job keeps reporting its failure to
// ranks that arrive after everybody else has gone.
const failedJobGrace = 10 * time.Second

// Lengths of identifiers. They keep the pre-authentication frame small.
const (
	maxTokenLen   = 1024
	maxJobLen     = 256
	maxAttemptLen = 256
	maxLaunchLen  = 256
	maxKeyLen     = 1024
	// helloLimit is the frame limit until a client has authenticated: a Hello
	// with every string at its longest fits.
	helloLimit = 1 + len(helloMagic) + 1 + 4*2 + maxTokenLen + maxJobLen + maxAttemptLen + maxLaunchLen + 8 + 2*4
)

// ServerConfig configures a Server. Zero numeric fields take the defaults
// above; negative ones are an error.
type ServerConfig struct {
	// Token is the shared secret every client must present. A server
	// without one refuses to serve unless Insecure is set, and then only
	// on a loopback address.
	Token    string
	Insecure bool

	// MaxMessageBytes caps one request frame (a put's key and value, a
	// get's key list). Before a client has authenticated, the cap is a
	// couple of KiB whatever this says.
	MaxMessageBytes int
	// MaxKeysPerJob caps the keys stored for one (job, attempt), and so
	// the world size: allgather stores one key per rank.
	MaxKeysPerJob int
	// MaxJobBytes caps the bytes (keys and values) stored for one job.
	MaxJobBytes int
	// MaxJobs caps the (job, attempt) namespaces held at once.
	MaxJobs int
	// MaxConns caps authenticated connections. Every waiting rank holds
	// one, so a shared server needs at least as many as the largest job
	// has ranks.
	MaxConns int
	// MaxUnauthenticated caps connections that have not said hello yet;
	// when it is reached, the oldest of them is closed. Idle sockets
	// therefore never take the slots of ranks.
	MaxUnauthenticated int

	// IdleTimeout bounds the wait for each request frame to arrive in
	// full; a client slower than that is dropped.
	IdleTimeout time.Duration
	// HelloTimeout bounds the wait for a new connection's hello (or
	// IdleTimeout, if that is shorter).
	HelloTimeout time.Duration
	// MaxWait caps how long one get may block, whatever the client asks.
	MaxWait time.Duration
	// JobTTL is how long a namespace nobody is connected to is kept
	// before it is garbage-collected.
	JobTTL time.Duration

	// Logger receives the server's log lines; the zero Logger discards them.
	Logger zerolog.Logger
}

func (c *ServerConfig) setDefaults() error {
	ints := []struct {
		name string
		v    *int
		def  int
		max  int
	}{
		{"MaxMessageBytes", &c.MaxMessageBytes, DefaultMaxMessageBytes, MaxFrameBytes},
		{"MaxKeysPerJob", &c.MaxKeysPerJob, DefaultMaxKeysPerJob, 1 << 24},
		{"MaxJobBytes", &c.MaxJobBytes, DefaultMaxJobBytes, MaxFrameBytes / 2},
		{"MaxJobs", &c.MaxJobs, DefaultMaxJobs, 1 << 24},
		{"MaxConns", &c.MaxConns, DefaultMaxConns, 1 << 24},
		{"MaxUnauthenticated", &c.MaxUnauthenticated, DefaultMaxUnauthenticated, 1 << 24},
	}
	for _, f := range ints {
		switch {
		case *f.v < 0:
			return fmt.Errorf("rendezvous: %s is negative (%d)", f.name, *f.v)
		case *f.v == 0:
			*f.v = f.def
		case *f.v > f.max:
			return fmt.Errorf("rendezvous: %s is %d, more than %d", f.name, *f.v, f.max)
		}
	}
	durs := []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"IdleTimeout", &c.IdleTimeout, DefaultIdleTimeout},
		{"HelloTimeout", &c.HelloTimeout, DefaultHelloTimeout},
		{"MaxWait", &c.MaxWait, DefaultMaxWait},
		{"JobTTL", &c.JobTTL, DefaultJobTTL},
	}
	for _, f := range durs {
		switch {
		case *f.v < 0:
			return fmt.Errorf("rendezvous: %s is negative (%s)", f.name, *f.v)
		case *f.v == 0:
			*f.v = f.def
		}
	}
	if len(c.Token) > maxTokenLen {
		return fmt.Errorf("rendezvous: token is %d bytes, more than %d", len(c.Token), maxTokenLen)
	}
	return nil
}

// Server is the rendezvous service. One Server may Serve several listeners;
// all its methods are safe for concurrent use.
type Server struct {
	cfg       ServerConfig
	log       zerolog.Logger
	tokenHash [sha256.Size]byte
	// pinned, when set, is the only namespace this server accepts (the
	// embedded server of HostAllgather); it is never collected or deleted.
	pinned *job

	mu        sync.Mutex
	jobs      map[jobKey]*job
	listeners map[net.Listener]struct{}
	sessions  map[*session]struct{}
	// pending holds the sessions that have not said hello, with the order
	// in which they came; authed counts the others.
	pending   map[*session]uint64
	nextSeq   uint64
	authed    int
	closing   bool
	quit      chan struct{} // closed when Shutdown starts
	gcStarted bool
	wg        sync.WaitGroup // sessions, rejections and the collector
}

// NewServer checks cfg and returns a server that is not yet listening. The
// token rule (no token only with Insecure, and then only on loopback) is
// checked by Serve, which knows the address.
func NewServer(cfg ServerConfig) (*Server, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	return &Server{
		cfg:       cfg,
		log:       cfg.Logger,
		tokenHash: sha256.Sum256([]byte(cfg.Token)),
		jobs:      make(map[jobKey]*job),
		listeners: make(map[net.Listener]struct{}),
		sessions:  make(map[*session]struct{}),
		pending:   make(map[*session]uint64),
		quit:      make(chan struct{}),
	}, nil
}

// checkAddr enforces the token rule for one listening address.
func (s *Server) checkAddr(addr net.Addr) error {
	if s.cfg.Token != "" {
		return nil
	}
	if !s.cfg.Insecure {
		return fmt.Errorf("rendezvous: refusing to serve on %s without a token (set one, or allow Insecure on a loopback address)", addr)
	}
	if !isLoopback(addr) {
		return fmt.Errorf("rendezvous: refusing to serve on %s without a token: Insecure is allowed on loopback addresses only", addr)
	}
	return nil
}

// checkListenAddr applies the token rule before listening, where the address
// says enough: an IP literal, "localhost", or no host at all (a wildcard).
// Host names are checked after listening, by Serve.
func (s *Server) checkListenAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("rendezvous: listen address %q: %w", addr, err)
	}
	if host == "localhost" {
		host = "127.0.0.1"
	}
	var ip net.IP
	switch {
	case host == "":
		ip = net.IPv6unspecified
	case net.ParseIP(host) != nil:
		ip = net.ParseIP(host)
	default:
		return nil
	}
	p, _ := strconv.Atoi(port)
	return s.checkAddr(&net.TCPAddr{IP: ip, Port: p})
}

func isLoopback(addr net.Addr) bool {
	tcp, ok := addr.(*net.TCPAddr)
	return ok && tcp.IP.IsLoopback()
}

// ListenAndServe listens on addr (DefaultAddr if empty) and serves until
// Shutdown, which makes it return ErrServerClosed.
func (s *Server) ListenAndServe(addr string) error {
	if addr == "" {
		addr = DefaultAddr
	}
	if err := s.checkListenAddr(addr); err != nil {
		return err
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("rendezvous: %w", err)
	}
	return s.Serve(l)
}

// Serve accepts connections on l until Shutdown (then it returns
// ErrServerClosed) or until l fails. Serve closes l.
func (s *Server) Serve(l net.Listener) error {
	if err := s.checkAddr(l.Addr()); err != nil {
		l.Close()
		return err
	}
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		l.Close()
		return ErrServerClosed
	}
	s.listeners[l] = struct{}{}
	if !s.gcStarted && s.pinned == nil {
		s.gcStarted = true
		s.wg.Add(1)
		go s.collect()
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
		l.Close()
	}()

	s.log.Info().Str("addr", l.Addr().String()).Bool("auth", s.cfg.Token != "").Msg("rendezvous server listening")
	var backoff time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if s.isClosing() {
				return ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Most other accept errors (out of file descriptors, a
			// connection reset before accept) pass; back off like net/http.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn().Err(err).Dur("retry_in", backoff).Msg("accept failed")
			select {
			case <-time.After(backoff):
			case <-s.quit:
				return ErrServerClosed
			}
			continue
		}
		backoff = 0
		s.admit(c)
	}
}

func (s *Server) isClosing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closing
}

// admit starts a session for c. A connection counts against MaxConns only
// once it has said hello (see session.hello); until then it is one of at
// most MaxUnauthenticated, and the oldest of those makes room for c.
func (s *Server) admit(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		c.Close()
		return
	}
	if len(s.pending) >= s.cfg.MaxUnauthenticated {
		var oldest *session
		for ss, seq := range s.pending {
			if oldest == nil || seq < s.pending[oldest] {
				oldest = ss
			}
		}
		delete(s.pending, oldest)
		oldest.conn.Close() // its goroutine logs and cleans up
		oldest.evicted = true
		s.log.Warn().Str("remote", oldest.conn.RemoteAddr().String()).Int("max_unauthenticated", s.cfg.MaxUnauthenticated).
			Msg("dropping client that has not said hello: too many such connections")
	}
	ss := &session{
		srv:  s,
		conn: c,
		br:   bufio.NewReader(c),
		log:  s.log.With().Str("remote", c.RemoteAddr().String()).Logger(),
		rank: -1,
	}
	s.sessions[ss] = struct{}{}
	s.pending[ss] = s.nextSeq
	s.nextSeq++
	s.wg.Add(1)
	go ss.serve()
}

// Shutdown stops the server: listeners close at once, blocked gets are
// answered with CodeShuttingDown (clients retry elsewhere or later), idle
// connections close. It waits for every connection to finish until ctx is
// done, then closes the rest forcibly and returns ctx.Err().
// Calling it more than once is safe.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if !s.closing {
		s.closing = true
		close(s.quit)
		for l := range s.listeners {
			l.Close()
		}
		now := time.Now()
		for ss := range s.sessions {
			ss.conn.SetReadDeadline(now)
		}
		s.log.Info().Int("connections", len(s.sessions)).Int("jobs", len(s.jobs)).Msg("rendezvous server shutting down")
	}
	s.mu.Unlock()

	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	s.mu.Lock()
	for ss := range s.sessions {
		ss.conn.Close()
	}
	s.mu.Unlock()
	<-done
	return ctx.Err()
}

// tokenOK compares digests, so that the comparison takes the same time
// whatever the lengths of the two tokens.
func (s *Server) tokenOK(token string) bool {
	if s.cfg.Token == "" {
		return true
	}
	h := sha256.Sum256([]byte(token))
	return subtle.ConstantTimeCompare(h[:], s.tokenHash[:]) == 1
}

// collect garbage-collects namespaces that nobody has been connected to for
// JobTTL.
func (s *Server) collect() {
	defer s.wg.Done()
	every := min(max(s.cfg.JobTTL/4, 10*time.Millisecond), time.Minute)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.quit:
			return
		case now := <-t.C:
			s.mu.Lock()
			s.expireLocked(now)
			s.mu.Unlock()
		}
	}
}

func (s *Server) expireLocked(now time.Time) int {
	n := 0
	for k, j := range s.jobs {
		if j != s.pinned && j.refs == 0 && now.Sub(j.touched) > s.cfg.JobTTL {
			delete(s.jobs, k)
			n++
			s.log.Info().Str("job", k.job).Str("attempt", k.attempt).Str("launch", k.launch).Int("keys", len(j.values)).
				Int("left", len(j.left)).Int("size", j.size).Dur("idle", now.Sub(j.touched)).Msg("expired job")
		}
	}
	return n
}

// describe names a namespace for messages, the launch by the start of its
// digest.
func (k jobKey) describe() string {
	s := fmt.Sprintf("job %q attempt %q", k.job, k.attempt)
	if k.launch != "" {
		s += fmt.Sprintf(" launch %.12s", k.launch)
	}
	return s
}

// jobFor finds or creates the namespace for a hello. It returns an error
// reply when the server cannot take one more job. Called with s.mu held.
func (s *Server) jobForLocked(h *Hello, now time.Time) (*job, *ErrorReply) {
	key := jobKey{h.Job, h.Attempt, h.Launch}
	if s.pinned != nil {
		if key != s.pinned.key {
			return nil, &ErrorReply{Code: CodeOtherJob, Message: fmt.Sprintf(
				"this address serves the rendezvous of %s, not of %s (another job's rank 0 hosts here)",
				s.pinned.key.describe(), key.describe())}
		}
		return s.pinned, nil
	}
	j := s.jobs[key]
	if j != nil && j.failed != nil && j.refs == 0 && now.Sub(j.failedAt) > min(failedJobGrace, s.cfg.JobTTL) {
		// Everybody who saw the failure has long gone; whoever comes now
		// is most likely a new run that kept its attempt id, and deserves
		// a clean slate rather than an old error.
		s.log.Info().Str("job", key.job).Str("attempt", key.attempt).Msg("replacing failed job nobody is connected to")
		delete(s.jobs, key)
		j = nil
	}
	if j == nil {
		if len(s.jobs) >= s.cfg.MaxJobs && s.expireLocked(now) == 0 {
			s.log.Warn().Str("job", key.job).Str("attempt", key.attempt).Int("max_jobs", s.cfg.MaxJobs).Msg("rejecting job: job limit reached")
			return nil, &ErrorReply{Code: CodeLimit, Message: fmt.Sprintf("server holds its limit of %d jobs", s.cfg.MaxJobs)}
		}
		j = newJob(key, int(h.Size), int(h.Rank), now)
		s.jobs[key] = j
		s.log.Info().Str("job", key.job).Str("attempt", key.attempt).Int("size", j.size).Msg("new job")
	}
	return j, nil
}
