package comm

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/rendezvous"
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
