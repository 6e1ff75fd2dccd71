// Package launch finds out which rank this process is, from the
// environment a launcher leaves (torchrun, Open MPI, MPICH/Intel MPI,
// Slurm), and runs N ranks of a command on this machine (halod bench
// --local N).
package launch

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Placement is this process's place in a job, as its launcher tells it.
// Unknown counts are -1.
type Placement struct {
	Launcher  string // "torchrun", "openmpi", "pmi", "slurm"
	Rank      int
	Size      int
	LocalRank int
	LocalSize int
	Nodes     int
	// MasterAddr and MasterPort are MASTER_ADDR and MASTER_PORT (rank 0's
	// host, and the port of torchrun's own store there), if set.
	MasterAddr, MasterPort string
	// JobID and Attempt name the job for the rendezvous, when the
	// launcher has names for them ("" otherwise).
	JobID   string
	Attempt string
}

// SingleHost reports whether every rank is known to run on this host.
func (p Placement) SingleHost() bool {
	return p.Nodes == 1 || (p.LocalSize > 0 && p.LocalSize == p.Size)
}

// Describe says where the placement came from, e.g. "torchrun: rank 3 of 8".
func (p Placement) Describe() string {
	return fmt.Sprintf("%s: rank %d of %d", p.Launcher, p.Rank, p.Size)
}

// launcher describes one launcher's variables.
type launcher struct {
	name                  string
	rank, size            string
	localRank, localSize  string
	nodes                 string
	jobID, attempt, extra string
}

// Order matters: torchrun may itself run under Slurm or MPI, and its own
// variables describe the processes it started.
var launchers = []launcher{
	{name: "torchrun", rank: "RANK", size: "WORLD_SIZE", localRank: "LOCAL_RANK", localSize: "LOCAL_WORLD_SIZE",
		jobID: "TORCHELASTIC_RUN_ID", attempt: "TORCHELASTIC_RESTART_COUNT"},
	{name: "openmpi", rank: "OMPI_COMM_WORLD_RANK", size: "OMPI_COMM_WORLD_SIZE",
		localRank: "OMPI_COMM_WORLD_LOCAL_RANK", localSize: "OMPI_COMM_WORLD_LOCAL_SIZE", jobID: "PMIX_NAMESPACE"},
	{name: "pmi", rank: "PMI_RANK", size: "PMI_SIZE", localRank: "MPI_LOCALRANKID", localSize: "MPI_LOCALNRANKS"},
	{name: "slurm", rank: "SLURM_PROCID", size: "SLURM_NTASKS", localRank: "SLURM_LOCALID",
		nodes: "SLURM_STEP_NUM_NODES", jobID: "SLURM_JOB_ID", attempt: "SLURM_RESTART_COUNT", extra: "SLURM_STEP_ID"},
}

// Variables lists every environment variable Detect reads, for halod info.
func Variables() []string {
	var vs []string
	for _, l := range launchers {
		for _, v := range []string{l.rank, l.size, l.localRank, l.localSize, l.nodes, l.jobID, l.attempt, l.extra} {
			if v != "" {
				vs = append(vs, v)
			}
		}
	}
	return append(vs, "SLURM_STEP_NUM_TASKS", "SLURM_NNODES", "MASTER_ADDR", "MASTER_PORT")
}

// MasterRendezvous is where the ranks meet when the launcher names rank 0's
// host: MASTER_ADDR, at port MASTER_PORT+1, since torchrun's own store
// listens on MASTER_PORT itself; at defaultPort when MASTER_PORT is unset.
// ok is false without MASTER_ADDR.
func (p Placement) MasterRendezvous(defaultPort string) (addr string, ok bool, err error) {
	if p.MasterAddr == "" {
		return "", false, nil
	}
	port := defaultPort
	if p.MasterPort != "" {
		n, err := strconv.Atoi(p.MasterPort)
		if err != nil || n < 1 || n > 65534 {
			return "", false, fmt.Errorf("MASTER_PORT=%q: want a port number from 1 to 65534 (the rendezvous takes MASTER_PORT+1)", p.MasterPort)
		}
		port = strconv.Itoa(n + 1)
	}
	return net.JoinHostPort(strings.Trim(p.MasterAddr, "[]"), port), true, nil
}

// Detect reads the launcher's variables through getenv. It returns ok =
// false when no launcher's rank and size are both set, and an error when
// they are set but make no sense.
func Detect(getenv func(string) string) (p Placement, ok bool, err error) {
	for _, l := range launchers {
		rs, ss := strings.TrimSpace(getenv(l.rank)), strings.TrimSpace(getenv(l.size))
		if rs == "" || ss == "" {
			continue
		}
		if l.name == "slurm" {
			// Inside srun, the step's own task count is the world.
			if v := strings.TrimSpace(getenv("SLURM_STEP_NUM_TASKS")); v != "" {
				ss = v
			}
		}
		p = Placement{Launcher: l.name, LocalRank: -1, LocalSize: -1, Nodes: -1}
		if p.Rank, err = atoi(l.rank, rs); err != nil {
			return p, false, err
		}
		sizeVar := l.size
		if p.Size, err = atoi(sizeVar, ss); err != nil {
			return p, false, err
		}
		if p.Size < 1 || p.Rank < 0 || p.Rank >= p.Size {
			return p, false, fmt.Errorf("%s says rank %d of %d (%s=%q, %s=%q), which is out of range", l.name, p.Rank, p.Size, l.rank, rs, sizeVar, ss)
		}
		opt := func(name string) int {
			if name == "" {
				return -1
			}
			if n, err := strconv.Atoi(strings.TrimSpace(getenv(name))); err == nil && n >= 0 {
				return n
			}
			return -1
		}
		p.LocalRank, p.LocalSize, p.Nodes = opt(l.localRank), opt(l.localSize), opt(l.nodes)
		if l.name == "slurm" && p.Nodes < 0 {
			p.Nodes = opt("SLURM_NNODES")
		}
		// torchrun sets them; under another launcher a user may export them.
		p.MasterAddr = strings.TrimSpace(getenv("MASTER_ADDR"))
		p.MasterPort = strings.TrimSpace(getenv("MASTER_PORT"))
		if l.jobID != "" {
			p.JobID = getenv(l.jobID)
			if l.extra != "" && p.JobID != "" && getenv(l.extra) != "" {
				p.JobID += "." + getenv(l.extra)
			}
		}
		if l.attempt != "" {
			p.Attempt = getenv(l.attempt)
		}
		return p, true, nil
	}
	return Placement{}, false, nil
}

func atoi(name, v string) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("%s=%q is not a number", name, v)
	}
	return n, nil
}
