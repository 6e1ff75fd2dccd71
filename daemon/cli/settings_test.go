package cli

import (
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/halo-cp/halo/comm"
	ucli "github.com/urfave/cli/v2"
)

// The flags that stand for a library setting take its variable and its
// default from comm's table, and every duration and switch is read by the
// library's parsers.
func TestFlagsUseTheSettingsTable(t *testing.T) {
	shared := map[string]map[string]comm.Setting{
		"bench": {
			"rendezvous": comm.SettingRendezvous, "external-rendezvous": comm.SettingRendezvousExternal,
			"token": comm.SettingToken, "job-id": comm.SettingJobID, "attempt": comm.SettingJobAttempt,
			"timeout": comm.SettingTimeout, "bootstrap-timeout": comm.SettingBootstrapTimeout, "transfer": comm.SettingTransfer,
		},
		"serve": {"token": comm.SettingToken},
	}
	library := map[string]bool{}
	for _, s := range comm.Settings {
		library[s.Env] = true
	}
	app := newApp(nil, io.Discard, io.Discard)
	for _, c := range app.Commands {
		for _, f := range c.Flags {
			name := f.Names()[0]
			where := "halod " + c.Name + " --" + name
			switch f.(type) {
			case *ucli.BoolFlag:
				t.Errorf("%s is a ucli.BoolFlag, whose variable strconv.ParseBool reads: make it a boolFlag", where)
			case *ucli.DurationFlag:
				t.Errorf("%s is a ucli.DurationFlag, whose variable time.ParseDuration reads: make it a millis GenericFlag", where)
			}
			env := f.(interface{ GetEnvVars() []string }).GetEnvVars()
			s, ok := shared[c.Name][name]
			if !ok {
				for _, e := range env {
					if library[e] {
						t.Errorf("%s reads the library's %s: list it here", where, e)
					}
				}
				continue
			}
			if len(env) != 1 || env[0] != s.Env {
				t.Errorf("%s reads %v, want %s", where, env, s.Env)
			}
			g, ok := f.(*ucli.GenericFlag)
			if !ok {
				continue
			}
			switch v := g.Value.(type) {
			case *millis:
				if want, _ := comm.ParseDuration(s.Default); time.Duration(*v) != want {
					t.Errorf("%s defaults to %v, the library to %s", where, time.Duration(*v), s.Default)
				}
			case *transfer:
				if v.String() != s.Default {
					t.Errorf("%s defaults to %s, the library to %s", where, v, s.Default)
				}
			}
		}
	}
}

// parse runs flags over args and the environment env (every other HALO_
// variable unset) and hands the context to got.
func parse(t *testing.T, flags []ucli.Flag, env []string, args []string, got func(*ucli.Context)) error {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "HALO_") {
			t.Setenv(k, "")
		}
	}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	app := &ucli.App{Name: "halod", Flags: flags, Writer: io.Discard, ErrWriter: io.Discard,
		Action: func(c *ucli.Context) error { got(c); return nil }}
	return app.Run(append([]string{"halod"}, args...))
}

func TestFlagsReadTheLibrarysForms(t *testing.T) {
	type benchSeen struct {
		timeout, boot, dur            time.Duration
		check, checkSet, inPlace, ext bool
		transfer                      string
	}
	seen := func(env []string, args ...string) (s benchSeen) {
		t.Helper()
		err := parse(t, benchFlags(), env, args, func(c *ucli.Context) {
			s = benchSeen{duration(c, "timeout"), duration(c, "bootstrap-timeout"), duration(c, "duration"),
				c.Bool("check"), c.IsSet("check"), c.Bool("in-place"), c.Bool("external-rendezvous"), c.Generic("transfer").(*transfer).String()}
		})
		if err != nil {
			t.Fatalf("env %v, args %v: %v", env, args, err)
		}
		return s
	}
	got := seen([]string{"HALO_TIMEOUT_MS=5000", "HALO_BOOTSTRAP_TIMEOUT_MS=2s", "HALO_BENCH_DURATION=250",
		"HALO_BENCH_CHECK=ON", "HALO_BENCH_IN_PLACE=off", "HALO_RENDEZVOUS_EXTERNAL=yes", "HALO_TRANSFER=PACK"})
	want := benchSeen{5 * time.Second, 2 * time.Second, 250 * time.Millisecond, true, true, false, true, "pack"}
	if got != want {
		t.Errorf("from the environment: %+v, want %+v", got, want)
	}
	// Empty is unset: the defaults, the table's for the timeouts.
	got = seen([]string{"HALO_TIMEOUT_MS=", "HALO_BENCH_CHECK=", "HALO_BENCH_IN_PLACE=", "HALO_TRANSFER="})
	def, _ := comm.ParseDuration(comm.SettingTimeout.Default)
	defBoot, _ := comm.ParseDuration(comm.SettingBootstrapTimeout.Default)
	want = benchSeen{def, defBoot, 300 * time.Millisecond, false, false, true, false, "auto"}
	if got != want {
		t.Errorf("empty variables: %+v, want %+v", got, want)
	}
	// The command line wins over the environment.
	got = seen([]string{"HALO_BENCH_CHECK=on", "HALO_BENCH_IN_PLACE=1", "HALO_TIMEOUT_MS=5000"}, "--check=false", "--in-place=false", "--timeout", "3s")
	if got.check || got.inPlace || got.timeout != 3*time.Second {
		t.Errorf("command line over environment: %+v", got)
	}
	// The variable and the alias together are not two forms of one flag.
	if got = seen([]string{"HALO_BENCH_CHECK=on"}, "-c"); !got.check || !got.checkSet {
		t.Errorf("HALO_BENCH_CHECK=on -c: %+v", got)
	}

	for _, env := range []string{"HALO_TIMEOUT_MS=abc", "HALO_TIMEOUT_MS=288230376151711745", "HALO_BOOTSTRAP_TIMEOUT_MS=0",
		"HALO_BENCH_DURATION=-1s", "HALO_BENCH_CHECK=maybe", "HALO_RENDEZVOUS_EXTERNAL=2", "HALO_TRANSFER=zip"} {
		err := parse(t, benchFlags(), []string{env}, nil, func(*ucli.Context) {})
		if name, _, _ := strings.Cut(env, "="); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: got %v, want an error naming %s", env, err, name)
		}
	}

	var idle time.Duration
	var insecure bool
	if err := parse(t, serveFlags(), []string{"HALO_IDLE_TIMEOUT=5000", "HALO_INSECURE=yes"}, nil, func(c *ucli.Context) {
		idle, insecure = duration(c, "idle-timeout"), c.Bool("insecure")
	}); err != nil || idle != 5*time.Second || !insecure {
		t.Errorf("serve: %v, idle timeout %v, insecure %v", err, idle, insecure)
	}
	for _, env := range []string{"HALO_MAX_WAIT=0", "HALO_JOB_TTL=soon", "HALO_SHUTDOWN_TIMEOUT=-5", "HALO_INSECURE=sure"} {
		err := parse(t, serveFlags(), []string{env}, nil, func(*ucli.Context) {})
		if name, _, _ := strings.Cut(env, "="); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: got %v, want an error naming %s", env, err, name)
		}
	}
}
