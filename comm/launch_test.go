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

// A job on a shared rendezvous with nothing naming it would meet any other
// such job (issue 24 §1: two token-holding jobs on one halod serve swapped
// data); it is refused before it meets anyone, and a name or a launcher's
// variables let it through. One-command runs on loopback stay as they were.
func TestSharedRendezvousNeedsAJobIdentity(t *testing.T) {
	saved := Getenv
	t.Cleanup(func() { Getenv = saved })
	cases := []struct {
		name   string
		env    map[string]string
		cfg    Config
		refuse bool
	}{
		{"shared serve, token only", map[string]string{"HALO_TOKEN": "t"},
			Config{Rank: 1, Size: 2, Rendezvous: "127.0.0.1:29700", ExternalServer: true}, true},
		{"off loopback, token only", map[string]string{"HALO_TOKEN": "t"},
			Config{Rank: 0, Size: 2, Rendezvous: "198.18.0.1:29700"}, true},
		{"shared serve, job id set", map[string]string{"HALO_TOKEN": "t", "HALO_JOB_ID": "a"},
			Config{Rank: 1, Size: 2, Rendezvous: "127.0.0.1:29700", ExternalServer: true}, false},
		{"shared serve, job id passed", map[string]string{"HALO_TOKEN": "t"},
			Config{Rank: 1, Size: 2, Rendezvous: "127.0.0.1:29700", ExternalServer: true, Job: "a"}, false},
		{"shared serve, torchrun", map[string]string{"HALO_TOKEN": "t", "TORCHELASTIC_RUN_ID": "r1"},
			Config{Rank: 1, Size: 2, Rendezvous: "127.0.0.1:29700", ExternalServer: true}, false},
		{"loopback, rank 0 hosts", map[string]string{},
			Config{Rank: 1, Size: 2, Rendezvous: "127.0.0.1:29700"}, false},
	}
	for _, c := range cases {
		Getenv = func(k string) string { return c.env[k] }
		cfg := c.cfg
		err := cfg.fill()
		switch {
		case c.refuse && (err == nil || !strings.Contains(err.Error(), "HALO_JOB_ID") || !strings.Contains(err.Error(), "rank "+strconv.Itoa(c.cfg.Rank))):
			t.Errorf("%s: want a refusal naming the rank and HALO_JOB_ID, got %v", c.name, err)
		case !c.refuse && err != nil:
			t.Errorf("%s: %v", c.name, err)
		}
	}
}
