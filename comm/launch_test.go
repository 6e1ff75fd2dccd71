package comm

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

func TestLaunchIdentity(t *testing.T) {
	env := func(kv ...string) func(string) string {
		m := map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return func(k string) string { return m[k] }
	}
	none := env()
	// Nothing names the launch off loopback, or when the job is named.
	if id, _ := launchIdentity(false, false, none); id != "" {
		t.Errorf("no launcher, not loopback: %q", id)
	}
	if id, _ := launchIdentity(true, true, none); id != "" {
		t.Errorf("no launcher, named job: %q", id)
	}
	// On loopback, an unnamed job is its parent process's.
	id, desc := launchIdentity(true, false, none)
	if id == "" || !strings.Contains(desc, "parent process "+strconv.Itoa(os.Getppid())) {
		t.Errorf("parent: %q, %q", id, desc)
	}
	// Launchers' ids, on any host; runs differ, ranks of one run agree.
	a, _ := launchIdentity(false, true, env("SLURM_JOB_ID", "12", "SLURM_STEP_ID", "0"))
	b, _ := launchIdentity(false, true, env("SLURM_JOB_ID", "12", "SLURM_STEP_ID", "1"))
	a2, desc := launchIdentity(false, true, env("SLURM_JOB_ID", "12", "SLURM_STEP_ID", "0"))
	if a == "" || a == b || a != a2 || desc != "SLURM_JOB_ID=12, SLURM_STEP_ID=0" {
		t.Errorf("slurm: %q %q %q %q", a, b, a2, desc)
	}
	for _, v := range []string{"TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"} {
		if id, _ := launchIdentity(false, false, env(v, "x")); id == "" {
			t.Errorf("%s is not a launch id", v)
		}
	}
	// torchrun's default run id is the same string for every run: the
	// parent process still tells local runs apart.
	t1, d := launchIdentity(true, false, env("TORCHELASTIC_RUN_ID", "none"))
	if t1 == "" || !strings.Contains(d, "TORCHELASTIC_RUN_ID=none, parent process") {
		t.Errorf("torchrun default: %q", d)
	}
}
