// Package comm assembles a communicator from the parts: a UCX transport,
// a bootstrap (the rendezvous, or addresses the caller brings) and the
// algorithm's Group. The C ABI and halod both build on it.
package comm

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/transport"
	"github.com/halo-cp/halo/rendezvous"
	"github.com/halo-cp/halo/ucx"
)

// Comm is one rank's communicator.
type Comm struct {
	cfg       Config
	t         *ucx.Transport
	job       [16]byte // the job's name in address envelopes
	address   []byte   // this rank's address, sealed (address.go)
	mu        sync.Mutex
	g         *halo.Group
	closed    bool
	connected bool
	// presence keeps this rank in its job on a shared server while it runs
	// (rendezvous.Present); failure is why the server then failed the job.
	presence *rendezvous.Presence
	failure  atomic.Pointer[string]
	// live holds a link to every peer that tells of its death at once
	// (liveness.go); nil for world size 1 or where no listener opened.
	live *liveness
	st   streams // the proxy and the requests (requests.go)
}

// New opens the transport and, with the rendezvous bootstrap, connects
// every rank. With BootstrapExternal the caller then reads Address on every
// rank, exchanges them, and calls Connect.
func New(cfg Config) (*Comm, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	// ucx.Options' zero value leaves peer error handling off (it costs
	// single-copy large messages); DetectPeerFailure turns it on.
	t, err := ucx.Open(cfg.Rank, cfg.Size, ucx.Options{PeerErrorHandling: cfg.DetectPeerFailure, SpinPolls: cfg.SpinPolls})
	if err != nil {
		return nil, fmt.Errorf("rank %d: opening UCX: %w", cfg.Rank, classify(err))
	}
	c := &Comm{cfg: cfg, t: t, job: jobDigest(cfg.Job, cfg.Attempt)}
	c.live = listenLiveness(cfg.Rank, cfg.Size, t.PeerGone)
	c.address = sealAddress(t.Address(), c.live.endpoint(), cfg.Rank, cfg.Size, c.job)
	if cfg.Bootstrap == BootstrapExternal {
		return c, nil
	}
	addrs, err := c.rendezvous()
	if err == nil {
		err = c.connect(addrs, halo.ErrRendezvous, "from the rendezvous: ")
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	if c.presence != nil {
		go c.watchPresence(c.presence)
	}
	return c, nil
}

// watchPresence fails the communicator when the shared server says that a
// rank of another run arrived under this job's name: the ranks this one met
// may belong to either run, so no exchange of it can be trusted.
func (c *Comm) watchPresence(p *rendezvous.Presence) {
	<-p.Done()
	if err := p.Err(); err != nil {
		why := fmt.Sprintf("rank %d: the rendezvous at %s failed this job while it ran: %v", c.cfg.Rank, c.cfg.Rendezvous, err)
		c.failure.Store(&why)
		c.t.Abort()
	}
}

func (c *Comm) rendezvous() ([][]byte, error) {
	cfg := c.cfg
	if cfg.Size == 1 {
		return [][]byte{c.address}, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.BootstrapTimeout)
	defer cancel()
	cc := rendezvous.ClientConfig{Addr: cfg.Rendezvous, Token: cfg.Token, Job: cfg.Job, Attempt: cfg.Attempt,
		Launch: cfg.Launch, Rank: cfg.Rank, Size: cfg.Size, Timeout: cfg.BootstrapTimeout}
	var addrs [][]byte
	var err error
	switch {
	case cfg.Rank == 0 && !cfg.ExternalServer:
		addrs, err = rendezvous.HostAllgather(ctx, cfg.Rendezvous, cc, c.address)
	case cfg.ExternalServer:
		// Stay connected while the communicator lives: the shared server
		// then knows the job is running and refuses latecomers under its name.
		addrs, c.presence, err = rendezvous.Present(ctx, cc, c.address)
	default:
		addrs, err = rendezvous.Allgather(ctx, cc, c.address)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: rank %d via %s: %v%s", halo.ErrRendezvous, cfg.Rank, cfg.Rendezvous, err, c.hint(err))
	}
	return addrs, nil
}

// hint says which setting changes the outcome of a failed rendezvous.
func (c *Comm) hint(err error) string {
	cfg := c.cfg
	launch := ""
	if cfg.LaunchDesc != "" {
		launch = " (this rank's launch: " + cfg.LaunchDesc + ")"
	}
	switch {
	case errors.Is(err, rendezvous.CodeDuplicate):
		return fmt.Sprintf(". Give each run its own %s (or %s)", SettingJobAttempt.Env, SettingJobID.Env)
	case errors.Is(err, rendezvous.CodeOtherJob):
		return fmt.Sprintf(". Another job's rank 0 holds %s%s: give this job a free host:port in %s on every rank; "+
			"ranks of one job started by different processes must share %s", cfg.Rendezvous, launch, SettingRendezvous.Env, SettingJobID.Env)
	case errors.Is(err, rendezvous.ErrAddressInUse):
		return fmt.Sprintf(". Set %s to a free host:port on every rank of this job", SettingRendezvous.Env)
	case errors.Is(err, rendezvous.ErrSharedServer):
		return fmt.Sprintf(". To use that server, set %s=1 on every rank; otherwise set %s to a free host:port",
			SettingRendezvousExternal.Env, SettingRendezvous.Env)
	}
	return ""
}

// Rank and Size of this communicator.
func (c *Comm) Rank() int { return c.cfg.Rank }
func (c *Comm) Size() int { return c.cfg.Size }

// Config returns the effective configuration.
func (c *Comm) Config() Config { return c.cfg }

// Address is this rank's address, for an external bootstrap: UCX's worker
// address in halo's envelope (address.go), opaque to the caller.
func (c *Comm) Address() []byte { return c.address }

// Connect takes every rank's address (from Address), in rank order. An
// address that is not whole, not for its slot, or not usable by UCX is
// refused with ErrInvalid, naming the rank, before UCX sees it.
func (c *Comm) Connect(addrs [][]byte) error {
	return c.connect(addrs, halo.ErrInvalid, "")
}

// connect checks addrs, classing a bad one as class, and connects.
func (c *Comm) connect(addrs [][]byte, class error, from string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("rank %d: connect: %w", c.cfg.Rank, halo.ErrClosed)
	}
	if c.connected {
		return fmt.Errorf("%w: rank %d: the communicator is already connected", halo.ErrState, c.cfg.Rank)
	}
	if len(addrs) != c.cfg.Size {
		return fmt.Errorf("%w: rank %d: %d addresses for world size %d", halo.ErrInvalid, c.cfg.Rank, len(addrs), c.cfg.Size)
	}
	raw, live, err := checkAddresses(addrs, c.cfg.Rank, c.address, c.job, c.t.CheckAddress)
	if err != nil {
		return fmt.Errorf("%w: rank %d: %s%v", class, c.cfg.Rank, from, err)
	}
	if err := c.t.Connect(raw); err != nil {
		return fmt.Errorf("rank %d: connecting: %w", c.cfg.Rank, classify(err))
	}
	c.live.connect(live)
	g, err := halo.NewGroup(wire{c.t, c.cfg.Timeout, c.cfg.TimeoutFrom, &c.failure, c.sawDeath}, halo.GroupOptions{Timeout: c.cfg.Timeout, Transfer: c.cfg.Transfer})
	if err != nil {
		return err
	}
	c.g, c.connected = g, true
	return nil
}

// NewPlan creates a plan collectively (see halo.Group.NewPlan).
func (c *Comm) NewPlan(spec halo.Spec) (*halo.Plan, error) {
	return c.NewMultiPlan([]halo.Spec{spec}, false)
}

// NewMultiPlan creates a plan over several layouts, collectively
// (halo.Group.NewMultiPlan) or, deferred, locally with the agreement at
// its first exchange (halo.Group.NewDeferredPlan).
func (c *Comm) NewMultiPlan(specs []halo.Spec, deferred bool) (*halo.Plan, error) {
	c.mu.Lock()
	g, closed := c.g, c.closed
	c.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("rank %d: plan create: %w", c.cfg.Rank, halo.ErrClosed)
	}
	if g == nil {
		return nil, fmt.Errorf("%w: rank %d: the communicator is not connected yet (call connect with every rank's address)", halo.ErrState, c.cfg.Rank)
	}
	if deferred {
		return g.NewDeferredPlan(specs)
	}
	return g.NewMultiPlan(specs)
}

// MemoryTypes is the set of halo memory types (1 << transport.Memory) the
// communicator's transport moves itself; CUDA is missing where UCX was
// built without it, and then CUDA tensors must be staged through host memory.
func (c *Comm) MemoryTypes() uint64 {
	var set uint64
	for _, m := range []transport.Memory{transport.Host, transport.CUDA} {
		if c.t.Moves(m) {
			set |= 1 << m
		}
	}
	return set
}

// Abort stops the communicator from any goroutine, also while another one
// is inside an exchange: that exchange and every later call fail with
// halo.ErrFailed within milliseconds (UCX's waits are woken), after which
// Close is immediate.
func (c *Comm) Abort() {
	c.abortProxy() // first: no queued stream-ordered exchange begins on it
	c.t.Abort()
	// Peers hear of it as soon as the wait that holds the transport ends.
	go c.t.Goodbye()
	c.mu.Lock()
	g := c.g
	c.mu.Unlock()
	if g != nil {
		g.Abort()
	}
}

// sawDeath is called when an exchange failed because a peer died (its
// process ended, or its endpoint failed), which nobody else may have heard
// of: ranks that exchange only with this one would wait for it until their
// deadline. So the failure spreads as an abort does: the peers' exchanges
// with this rank fail PEER_FAILED at once ("rank r aborted"). The group
// has already failed (the exchange records why); only the wire is told,
// and its goodbye names the dead rank.
func (c *Comm) sawDeath(peer int) {
	c.t.AbortFor(peer)
	c.t.Goodbye()
}

// Close ends the requests and the proxy (the queued stream-ordered
// exchanges run first), then releases the transport; plans made on it must
// be closed before (CloseProxy, then the plans, then Close, where exchanges
// may be queued on them). Safe to call twice.
func (c *Comm) Close() error {
	perr := c.closeProxy()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if c.presence != nil {
		c.presence.Close()
	}
	// The liveness goodbye first: the peers then take the links' end for
	// a close, not a death, and hear the rest from UCX's goodbye.
	c.live.close(!c.t.Aborted())
	if err := classify(c.t.Close()); err != nil {
		return err
	}
	return perr
}

// wire adapts ucx.Transport, which knows nothing of halo, to the
// algorithm's transport interface: the operations are the same type; only the
// errors are classed on the way up.
type wire struct {
	t           *ucx.Transport
	deadline    time.Duration // the configured deadline (a wait may get what is left of it)
	timeoutFrom string        // where the deadline came from, for timeout messages
	failure     *atomic.Pointer[string]
	sawDeath    func(peer int) // after an operation failed on a dead peer (Comm.sawDeath)
}

// classify is the package's classify, except that an abort the rendezvous
// caused says why.
func (a wire) classify(err error) error {
	if why := a.failure.Load(); why != nil && errors.Is(err, ucx.ErrAborted) {
		return halo.Classify(halo.ErrRendezvous, fmt.Errorf("%s (%w)", *why, err))
	}
	return classify(err)
}

func (a wire) Rank() int { return a.t.Rank() }
func (a wire) Size() int { return a.t.Size() }

// Moves makes the wire a transport.MemoryTyped: UCX says which memory it moves.
func (a wire) Moves(m transport.Memory) bool { return a.t.Moves(m) }

func (a wire) Prepare(ops []transport.Op) (transport.Batch, error) {
	b, err := a.t.Prepare(ops)
	if err != nil {
		return nil, a.classify(err)
	}
	return wireBatch{b, a}, nil
}

func (a wire) Alloc(n int) (transport.Buffer, error) {
	b, err := a.t.Alloc(n)
	if err != nil {
		return nil, classify(err)
	}
	return b, nil
}

type wireBatch struct {
	b *ucx.Batch
	w wire
}

func (b wireBatch) Post(bases []uintptr, tagOr uint64) error {
	return b.w.classify(b.b.Post(bases, tagOr))
}
func (b wireBatch) Received(i int) (uint64, int64) { return b.b.Received(i) }
func (b wireBatch) Wait(timeout time.Duration) error {
	raw := b.b.WaitFor(timeout)
	if r := deadPeer(raw); r >= 0 && b.w.sawDeath != nil {
		b.w.sawDeath(r)
	}
	err := b.w.classify(raw)
	if errors.Is(err, halo.ErrTimeout) {
		// Say which deadline ran out and who set it: a value set too late
		// (or not at all) is the usual surprise.
		return fmt.Errorf("%w (deadline %v, from %s)", err, b.w.deadline, b.w.timeoutFrom)
	}
	return err
}
func (b wireBatch) Test() (bool, error) {
	done, err := b.b.Test()
	if r := deadPeer(err); r >= 0 && b.w.sawDeath != nil {
		b.w.sawDeath(r)
	}
	return done, b.w.classify(err)
}

// deadPeer is the first peer of err whose operation failed because it died
// rather than said goodbye (a peer that closed or aborted told every rank
// itself), or -1.
func deadPeer(err error) int {
	if err == nil {
		return -1
	}
	if pe, ok := err.(*ucx.PeerError); ok {
		if pe.Status == ucx.StatusPeerClosed || pe.Status == ucx.StatusPeerAborted {
			return -1
		}
		return pe.Rank
	}
	switch u := err.(type) {
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if r := deadPeer(e); r >= 0 {
				return r
			}
		}
	case interface{ Unwrap() error }:
		return deadPeer(u.Unwrap())
	}
	return -1
}
func (b wireBatch) Close() error { return b.w.classify(b.b.Close()) }

// classify maps an error of the ucx package onto halo's classes. A wait that
// failed on several operations is classed by the first that applies, in the
// order below: a timeout names every peer still pending, which says most.
func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ucx.ErrAborted):
		return halo.Classify(halo.ErrFailed, err)
	case errors.Is(err, ucx.ErrTimeout):
		return halo.Classify(halo.ErrTimeout, err)
	case errors.Is(err, ucx.ErrPeerFailed):
		return halo.Classify(halo.ErrPeerFailed, err)
	case errors.Is(err, ucx.ErrClosed):
		return halo.Classify(halo.ErrClosed, err)
	case errors.Is(err, ucx.ErrMemoryType):
		return halo.Classify(halo.ErrInvalid, err)
	}
	return halo.Classify(halo.ErrTransport, err)
}
