// Package comm assembles a communicator from the parts: a UCX transport,
// a bootstrap (the rendezvous, or addresses the caller brings) and the
// algorithm's Group. The C ABI and halod both build on it.
package comm

import (
	"context"
	"errors"
	"fmt"
	"sync"
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
	mu        sync.Mutex
	g         *halo.Group
	closed    bool
	connected bool
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
		return nil, fmt.Errorf("%w: rank %d via %s: %v", halo.ErrRendezvous, cfg.Rank, cfg.Rendezvous, err)
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
		return fmt.Errorf("%w: rank %d: the communicator is already connected", halo.ErrState, c.cfg.Rank)
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
		return fmt.Errorf("rank %d: connecting: %w", c.cfg.Rank, classify(err))
	}
	g, err := halo.NewGroup(wire{c.t}, halo.GroupOptions{Timeout: c.cfg.Timeout, Transfer: c.cfg.Transfer})
	if err != nil {
		return err
	}
	c.g, c.connected = g, true
	return nil
}

// NewPlan creates a plan collectively (see halo.Group.NewPlan).
func (c *Comm) NewPlan(spec halo.Spec) (*halo.Plan, error) {
	return c.NewMultiPlan([]halo.Spec{spec})
}

// NewMultiPlan creates a plan over several layouts (halo.Group.NewMultiPlan).
func (c *Comm) NewMultiPlan(specs []halo.Spec) (*halo.Plan, error) {
	c.mu.Lock()
	g, closed := c.g, c.closed
	c.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("rank %d: plan create: %w", c.cfg.Rank, halo.ErrClosed)
	}
	if g == nil {
		return nil, fmt.Errorf("%w: rank %d: the communicator is not connected yet (call connect with every rank's address)", halo.ErrState, c.cfg.Rank)
	}
	return g.NewMultiPlan(specs)
}

// Abort stops the communicator from any goroutine, also while another one
// is inside an exchange: that exchange and every later call fail with
// halo.ErrFailed within milliseconds (UCX's waits are woken), after which
// Close is immediate.
func (c *Comm) Abort() {
	c.t.Abort()
	c.mu.Lock()
	g := c.g
	c.mu.Unlock()
	if g != nil {
		g.Abort()
	}
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
	return classify(c.t.Close())
}

// wire adapts ucx.Transport, which knows nothing of halo, to the
// algorithm's transport interface: the operations are the same type; only the
// errors are classed on the way up.
type wire struct{ t *ucx.Transport }

func (a wire) Rank() int { return a.t.Rank() }
func (a wire) Size() int { return a.t.Size() }

func (a wire) Prepare(ops []transport.Op) (transport.Batch, error) {
	b, err := a.t.Prepare(ops)
	if err != nil {
		return nil, classify(err)
	}
	return wireBatch{b}, nil
}

func (a wire) Alloc(n int) (transport.Buffer, error) {
	b, err := a.t.Alloc(n)
	if err != nil {
		return nil, classify(err)
	}
	return b, nil
}

type wireBatch struct{ b *ucx.Batch }

func (b wireBatch) Post(bases []uintptr) error    { return classify(b.b.Post(bases)) }
func (b wireBatch) Wait(deadline time.Time) error { return classify(b.b.Wait(deadline)) }
func (b wireBatch) Test() (bool, error) {
	done, err := b.b.Test()
	return done, classify(err)
}
func (b wireBatch) Close() error { return classify(b.b.Close()) }

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
	}
	return halo.Classify(halo.ErrTransport, err)
}
