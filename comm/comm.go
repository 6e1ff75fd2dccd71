// Package comm assembles a communicator from the parts: a UCX transport,
// a bootstrap (the rendezvous, or addresses the caller brings) and the
// algorithm's Group. The C ABI and halod both build on it.
package comm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/rendezvous"
	"github.com/halo-cp/halo/ucx"
)

// Bootstrap says how ranks find each other.
type Bootstrap int

const (
	BootstrapRendezvous Bootstrap = 0 // rank 0 (or halod serve) hosts the rendezvous
	BootstrapExternal   Bootstrap = 1 // the caller exchanges addresses (MPI, torch's store)
)

// Config describes one rank of a communicator. Empty fields fall back to
// the HALO_* environment, then to defaults.
type Config struct {
	Rank, Size       int
	Bootstrap        Bootstrap
	Rendezvous       string        // host:port; HALO_RENDEZVOUS; default 127.0.0.1:29700 (rendezvous.DefaultAddr)
	Token            string        // HALO_TOKEN; may be empty only on loopback
	Job              string        // HALO_JOB_ID; default "halo"
	Attempt          string        // HALO_JOB_ATTEMPT; default ""
	Timeout          time.Duration // every exchange wait; HALO_TIMEOUT_MS; default halo.DefaultTimeout
	BootstrapTimeout time.Duration // the rendezvous; HALO_BOOTSTRAP_TIMEOUT_MS; default 60s
	Transfer         halo.Transfer
	IOVMinSegment    int64
	// ExternalServer: the rendezvous is a shared halod serve; rank 0 does
	// not host one. HALO_RENDEZVOUS_EXTERNAL=1.
	ExternalServer bool
	// DetectPeerFailure turns on UCX peer error handling: a dead peer fails
	// the exchange within about a second instead of at the deadline, at the
	// cost of single-copy large messages. HALO_DETECT_PEER_FAILURE=1.
	DetectPeerFailure bool
	// SpinPolls is how long a wait polls before it yields the CPU between
	// polls (ucx.Options.SpinPolls); 0 is UCX's default, HALO_SPIN_POLLS.
	SpinPolls int
}

// DefaultRendezvous is where rank 0 listens when nothing else is said.
const DefaultRendezvous = rendezvous.DefaultAddr

// Comm is one rank's communicator.
type Comm struct {
	cfg       Config
	t         *ucx.Transport
	mu        sync.Mutex
	g         *halo.Group
	closed    bool
	connected bool
}

// Sentinels for the failure classes the C ABI reports.
var (
	ErrRendezvous = errors.New("rendezvous failed")
	ErrState      = errors.New("invalid state")
)

func envDuration(name string) (time.Duration, error) {
	v := os.Getenv(name)
	if v == "" {
		return 0, nil
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ms <= 0 {
		return 0, fmt.Errorf("%w: %s=%q is not a positive number of milliseconds", halo.ErrInvalid, name, v)
	}
	return time.Duration(ms) * time.Millisecond, nil
}

func (c *Config) fill() error {
	if c.Size < 1 || c.Size > 1<<20 {
		return fmt.Errorf("%w: world size %d is out of range [1, %d]", halo.ErrInvalid, c.Size, 1<<20)
	}
	if c.Rank < 0 || c.Rank >= c.Size {
		return fmt.Errorf("%w: rank %d is out of range for world size %d", halo.ErrInvalid, c.Rank, c.Size)
	}
	if c.Bootstrap != BootstrapRendezvous && c.Bootstrap != BootstrapExternal {
		return fmt.Errorf("%w: unknown bootstrap %d", halo.ErrInvalid, c.Bootstrap)
	}
	str := func(p *string, env, def string) {
		if *p == "" {
			*p = os.Getenv(env)
		}
		if *p == "" {
			*p = def
		}
	}
	str(&c.Rendezvous, "HALO_RENDEZVOUS", DefaultRendezvous)
	str(&c.Token, "HALO_TOKEN", "")
	str(&c.Job, "HALO_JOB_ID", "halo")
	str(&c.Attempt, "HALO_JOB_ATTEMPT", "")
	if os.Getenv("HALO_RENDEZVOUS_EXTERNAL") == "1" {
		c.ExternalServer = true
	}
	if v := os.Getenv("HALO_SPIN_POLLS"); v != "" && c.SpinPolls == 0 {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("%w: HALO_SPIN_POLLS=%q is not an integer", halo.ErrInvalid, v)
		}
		c.SpinPolls = n
	}
	if os.Getenv("HALO_DETECT_PEER_FAILURE") == "1" {
		c.DetectPeerFailure = true
	}
	for _, d := range []struct {
		p   *time.Duration
		env string
		def time.Duration
	}{{&c.Timeout, "HALO_TIMEOUT_MS", halo.DefaultTimeout}, {&c.BootstrapTimeout, "HALO_BOOTSTRAP_TIMEOUT_MS", 60 * time.Second}} {
		if *d.p < 0 {
			return fmt.Errorf("%w: timeout %v is negative", halo.ErrInvalid, *d.p)
		}
		if *d.p == 0 {
			v, err := envDuration(d.env)
			if err != nil {
				return err
			}
			*d.p = v
		}
		if *d.p == 0 {
			*d.p = d.def
		}
	}
	if c.Bootstrap == BootstrapRendezvous && c.Size > 1 {
		host, _, err := net.SplitHostPort(c.Rendezvous)
		if err != nil {
			return fmt.Errorf("%w: rendezvous address %q: %v (want host:port)", halo.ErrInvalid, c.Rendezvous, err)
		}
		if c.Token == "" && !isLoopback(host) {
			return fmt.Errorf("%w: rendezvous %s is not on loopback, so a token is required (set HALO_TOKEN or the token parameter)", halo.ErrInvalid, c.Rendezvous)
		}
	}
	return nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// New opens the transport and, with the rendezvous bootstrap, connects
// every rank. With BootstrapExternal the caller then reads Address on every
// rank, exchanges them, and calls Connect.
func New(cfg Config) (*Comm, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	// UCX 1.13 drops its single-copy CMA transport from endpoints with peer
	// error handling: 2 MiB halos then take 400 us instead of 200-265 us
	// (bench/RESULTS.md). So by default a dead peer is noticed at the
	// deadline; DetectPeerFailure notices it within about a second.
	opts := ucx.DefaultOptions()
	opts.PeerErrorHandling = cfg.DetectPeerFailure
	opts.SpinPolls = cfg.SpinPolls
	t, err := ucx.Open(cfg.Rank, cfg.Size, opts)
	if err != nil {
		return nil, fmt.Errorf("rank %d: opening UCX: %w", cfg.Rank, err)
	}
	c := &Comm{cfg: cfg, t: t}
	if cfg.Bootstrap == BootstrapExternal {
		return c, nil
	}
	addrs, err := c.rendezvous()
	if err == nil {
		err = c.Connect(addrs)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *Comm) rendezvous() ([][]byte, error) {
	cfg := c.cfg
	if cfg.Size == 1 {
		return [][]byte{c.t.Address()}, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.BootstrapTimeout)
	defer cancel()
	cc := rendezvous.ClientConfig{Addr: cfg.Rendezvous, Token: cfg.Token, Job: cfg.Job, Attempt: cfg.Attempt,
		Rank: cfg.Rank, Size: cfg.Size, Timeout: cfg.BootstrapTimeout}
	var addrs [][]byte
	var err error
	if cfg.Rank == 0 && !cfg.ExternalServer {
		addrs, err = rendezvous.HostAllgather(ctx, cfg.Rendezvous, cc, c.t.Address())
	} else {
		addrs, err = rendezvous.Allgather(ctx, cc, c.t.Address())
	}
	if err != nil {
		return nil, fmt.Errorf("%w: rank %d via %s: %v", ErrRendezvous, cfg.Rank, cfg.Rendezvous, err)
	}
	return addrs, nil
}

// Rank and Size of this communicator.
func (c *Comm) Rank() int { return c.cfg.Rank }
func (c *Comm) Size() int { return c.cfg.Size }

// Config returns the effective configuration.
func (c *Comm) Config() Config { return c.cfg }

// Address is this rank's UCX worker address, for an external bootstrap.
func (c *Comm) Address() []byte { return c.t.Address() }

// Connect takes every rank's address, in rank order.
func (c *Comm) Connect(addrs [][]byte) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("rank %d: connect: %w", c.cfg.Rank, halo.ErrClosed)
	}
	if c.connected {
		return fmt.Errorf("%w: rank %d: the communicator is already connected", ErrState, c.cfg.Rank)
	}
	if len(addrs) != c.cfg.Size {
		return fmt.Errorf("%w: rank %d: %d addresses for world size %d", halo.ErrInvalid, c.cfg.Rank, len(addrs), c.cfg.Size)
	}
	for r, a := range addrs {
		if len(a) == 0 {
			return fmt.Errorf("%w: rank %d: address of rank %d is empty", halo.ErrInvalid, c.cfg.Rank, r)
		}
	}
	if err := c.t.Connect(addrs); err != nil {
		return fmt.Errorf("rank %d: connecting: %w", c.cfg.Rank, err)
	}
	g, err := halo.NewGroup(transport{c.t}, halo.GroupOptions{Timeout: c.cfg.Timeout, Transfer: c.cfg.Transfer, IOVMinSegment: c.cfg.IOVMinSegment})
	if err != nil {
		return err
	}
	c.g, c.connected = g, true
	return nil
}

// NewPlan creates a plan collectively (see halo.Group.NewPlan).
func (c *Comm) NewPlan(spec halo.Spec) (*halo.Plan, error) {
	c.mu.Lock()
	g, closed := c.g, c.closed
	c.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("rank %d: plan create: %w", c.cfg.Rank, halo.ErrClosed)
	}
	if g == nil {
		return nil, fmt.Errorf("%w: rank %d: the communicator is not connected yet (call connect with every rank's address)", ErrState, c.cfg.Rank)
	}
	return g.NewPlan(spec)
}

// Close releases the transport; plans made on it must be closed first.
// Safe to call twice.
func (c *Comm) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	return c.t.Close()
}

// transport adapts ucx.Transport (which knows nothing of halo) to
// halo.Transport.
type transport struct{ t *ucx.Transport }

func (a transport) Rank() int { return a.t.Rank() }
func (a transport) Size() int { return a.t.Size() }

func (a transport) Prepare(ops []halo.Op) (halo.Batch, error) {
	u := make([]ucx.Op, len(ops))
	for i, op := range ops {
		segs := make([]ucx.Segment, len(op.Segs))
		for j, s := range op.Segs {
			segs[j] = ucx.Segment{Off: s.Off, Len: s.Len}
		}
		u[i] = ucx.Op{Peer: op.Peer, Tag: op.Tag, Send: op.Send, Base: op.Base, Segs: segs}
	}
	return a.t.Prepare(u)
}

func (a transport) Alloc(n int) (halo.Buffer, error) { return a.t.Alloc(n) }
