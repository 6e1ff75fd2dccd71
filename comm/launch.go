package comm

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// launcherVars are what launchers give every rank of one launch and no rank
// of another: torchrun's run id, PMIx's namespace (Open MPI 5, Slurm with
// PMIx), Open MPI 4's job id, Slurm's job and step. TORCHELASTIC_RESTART_COUNT
// is left out on purpose: an agent that joins late starts it at zero.
var launcherVars = []string{
	"TORCHELASTIC_RUN_ID",
	"PMIX_NAMESPACE",
	"OMPI_MCA_ess_base_jobid",
	"SLURM_JOB_ID",
	"SLURM_STEP_ID",
}

// launchIdentity says which launch this rank belongs to, so that two runs
// with the same job id and attempt never meet in the rendezvous: a digest
// of every launcher variable that is set and, when the job has no name of
// its own (job id, attempt and token all unset) and its rendezvous is on
// loopback (so every rank is on this host), of the parent process, which
// started the ranks of one launch. It returns "" when nothing names the
// launch, and a description of what went in, for messages.
func launchIdentity(loopback, named bool, getenv func(string) string) (id, desc string) {
	var parts []string
	for _, v := range launcherVars {
		if val := getenv(v); val != "" {
			parts = append(parts, v+"="+val)
		}
	}
	if loopback && !named {
		if p := parentIdentity(); p != "" {
			parts = append(parts, p)
		}
	}
	if len(parts) == 0 {
		return "", ""
	}
	desc = strings.Join(parts, ", ")
	h := sha256.Sum256([]byte("halo launch\x00" + desc))
	return hex.EncodeToString(h[:16]), desc
}

// parentIdentity names the parent process by pid and start time (pids are
// reused; a pid with its start time is not).
func parentIdentity() string {
	ppid := os.Getppid()
	id := "parent process " + strconv.Itoa(ppid)
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", ppid))
	if err != nil {
		return id
	}
	// pid (comm) state ppid ...: the command may hold spaces and parens,
	// so count fields after the last ')'. starttime is field 22.
	s := string(stat)
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		if f := strings.Fields(s[i+1:]); len(f) > 19 {
			id += " started at tick " + f[19]
		}
	}
	return id
}
