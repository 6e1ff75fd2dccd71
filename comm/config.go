package comm

import (
	"fmt"
	"net"
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

// Config describes one rank of a communicator. A zero field takes its
// setting (settings.go) from the HALO_* environment, else the setting's
// default.
type Config struct {
	Rank, Size       int
	Bootstrap        Bootstrap
	Rendezvous       string        // host:port; SettingRendezvous
	Token            string        // may be empty only on loopback; SettingToken
	Job              string        // SettingJobID
	Attempt          string        // SettingJobAttempt
	Timeout          time.Duration // every exchange wait; SettingTimeout
	BootstrapTimeout time.Duration // the rendezvous; SettingBootstrapTimeout
	// TimeoutFrom says where Timeout came from (the parameter, the
	// environment or the default), for the message of a wait that ran out.
	TimeoutFrom string
	Transfer    halo.Transfer // SettingTransfer
	CUDADriver  string        // "cuda" or "host-fake"; SettingCUDADriver
	// Launch names the launch this rank belongs to in the rendezvous, so
	// that runs sharing a job id and attempt never meet; "" derives it
	// from the launcher's environment (launch.go). LaunchDesc says what it
	// was derived from, for messages.
	Launch, LaunchDesc string
	// ExternalServer: the rendezvous is a shared halod serve; rank 0 does
	// not host one. SettingRendezvousExternal.
	ExternalServer bool
	// DetectPeerFailure turns on UCX peer error handling as well, at the
	// cost of single-copy large messages; a dead process is found without
	// it (liveness.go). SettingDetectPeerFailure.
	DetectPeerFailure bool
	// SpinPolls is how long a wait polls before it yields the CPU between
	// polls (ucx.Options.SpinPolls); SettingSpinPolls.
	SpinPolls int
}

// DefaultRendezvous is where rank 0 listens when nothing else is said.
const DefaultRendezvous = rendezvous.DefaultAddr

// fillFrom sets *p from s when *p is zero (unset).
func fillFrom[T comparable](p *T, s Setting, parse func(string) (T, error)) error {
	var zero T
	if *p != zero {
		return nil
	}
	v, err := lookup(s, parse)
	if err != nil {
		return err
	}
	*p = v
	return nil
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
	for _, d := range []*time.Duration{&c.Timeout, &c.BootstrapTimeout} {
		if *d < 0 {
			return fmt.Errorf("%w: timeout %v is negative", halo.ErrInvalid, *d)
		}
	}
	// Whether the job id is the caller's, before the default fills in.
	jobNamed := c.Job != "" || Getenv(SettingJobID.Env) != ""
	// Whether the job is named by the caller, before defaults fill in.
	named := c.Job != "" || c.Attempt != "" || c.Token != "" ||
		Getenv(SettingJobID.Env) != "" || Getenv(SettingJobAttempt.Env) != "" || Getenv(SettingToken.Env) != ""
	switch {
	case c.Timeout != 0:
		c.TimeoutFrom = "the communicator's timeout parameter"
	case Getenv(SettingTimeout.Env) != "":
		c.TimeoutFrom = SettingTimeout.Env + " in the environment"
	default:
		c.TimeoutFrom = "the default (" + SettingTimeout.Env + " unset)"
	}
	for _, err := range []error{
		fillFrom(&c.Rendezvous, SettingRendezvous, parseString),
		fillFrom(&c.Token, SettingToken, parseString),
		fillFrom(&c.Job, SettingJobID, parseString),
		fillFrom(&c.Attempt, SettingJobAttempt, parseString),
		fillFrom(&c.ExternalServer, SettingRendezvousExternal, ParseBool),
		fillFrom(&c.DetectPeerFailure, SettingDetectPeerFailure, ParseBool),
		fillFrom(&c.SpinPolls, SettingSpinPolls, ParseInt),
		fillFrom(&c.Timeout, SettingTimeout, ParseDuration),
		fillFrom(&c.BootstrapTimeout, SettingBootstrapTimeout, ParseDuration),
		fillFrom(&c.Transfer, SettingTransfer, ParseTransfer),
		fillFrom(&c.CUDADriver, SettingCUDADriver, ParseCUDADriver),
	} {
		if err != nil {
			return err
		}
	}
	if c.Bootstrap == BootstrapRendezvous && c.Size > 1 {
		host, _, err := net.SplitHostPort(c.Rendezvous)
		if err != nil {
			return fmt.Errorf("%w: rendezvous address %q: %v (want host:port)", halo.ErrInvalid, c.Rendezvous, err)
		}
		if c.Token == "" && !isLoopback(host) {
			return fmt.Errorf("%w: rendezvous %s is not on loopback, so a token is required (set %s or the token parameter)", halo.ErrInvalid, c.Rendezvous, SettingToken.Env)
		}
		if c.Launch == "" {
			c.Launch, c.LaunchDesc = launchIdentity(isLoopback(host), named, Getenv)
		}
		// On a rendezvous that other jobs share (a halod serve, or any
		// address off this host), a job with the default id and no
		// launcher variables has nothing that tells it from the next such
		// job: two of them would meet and swap data. Refuse before meeting
		// anyone, as NCCL's unique id makes crossing impossible.
		if (c.ExternalServer || !isLoopback(host)) && !jobNamed && c.Launch == "" {
			where := "is a shared halod serve (" + SettingRendezvousExternal.Env + ")"
			if !isLoopback(host) {
				where = "is not on loopback"
			}
			return fmt.Errorf("%w: rank %d: the rendezvous %s %s and nothing names this job: set %s to an id "+
				"that every rank of this job shares and no other job uses, or start the ranks with a launcher "+
				"(torchrun, mpirun, srun) whose variables name the run", halo.ErrInvalid, c.Rank, c.Rendezvous, where, SettingJobID.Env)
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
