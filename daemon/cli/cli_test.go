package cli

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/halo-cp/halo/comm"
	ucli "github.com/urfave/cli/v2"
)

func TestHelp(t *testing.T) {
	t.Parallel()
	r := halod(t, nil, "--help")
	if r.code != 0 {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
	for _, want := range []string{"serve", "bench", "info", "version", "halod bench --local 2 --check", "HALO_LOG_LEVEL"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("halod --help lacks %q:\n%s", want, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "bench-rank") {
		t.Errorf("the internal bench-rank command shows in the help")
	}
	for cmd, wants := range map[string][]string{
		"bench": {"--local N", "HALO_BENCH_LOCAL", "--check", "--shape", "torchrun", "HALO_TIMEOUT_MS", "--compare-perftest"},
		"serve": {"--token-file", "HALO_TOKEN", "--insecure", "HALO_MAX_CONNS", "--idle-timeout", "SIGTERM"},
		"info":  {"--json"},
	} {
		r := halod(t, nil, cmd, "--help")
		if r.code != 0 {
			t.Errorf("%s --help: exit %d", cmd, r.code)
		}
		for _, want := range wants {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("halod %s --help lacks %q:\n%s", cmd, want, r.stdout)
			}
		}
	}
}

// TestEveryFlagHasAnEnvironmentVariable walks the real command tree.
func TestEveryFlagHasAnEnvironmentVariable(t *testing.T) {
	app := newApp(nil, io.Discard, io.Discard)
	check := func(where string, flags []ucli.Flag) {
		for _, f := range flags {
			name := f.Names()[0]
			if name == "help" {
				continue
			}
			ev, ok := f.(interface{ GetEnvVars() []string })
			if !ok || len(ev.GetEnvVars()) == 0 {
				t.Errorf("%s --%s has no environment variable", where, name)
				continue
			}
			for _, v := range ev.GetEnvVars() {
				if !strings.HasPrefix(v, "HALO_") {
					t.Errorf("%s --%s reads %s, not a HALO_ variable", where, name, v)
				}
			}
			if strings.ToLower(name) != name || strings.Contains(name, "_") {
				t.Errorf("%s --%s is not kebab-case", where, name)
			}
		}
	}
	check("halod", app.Flags)
	for _, c := range app.Commands {
		check("halod "+c.Name, c.Flags)
	}
}

func TestBadUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  []string
		args []string
		want string
	}{
		{nil, []string{"frobnicate"}, `unknown command "frobnicate"`},
		{nil, []string{"bench", "--nope"}, "unknown flag --nope"},
		{nil, []string{"bench", "--local", "two"}, "--local"},
		{nil, []string{"bench"}, "--local N"},
		{nil, []string{"bench", "--local", "0"}, "--local 0"},
		{nil, []string{"bench", "--local", "2", "--dtype", "int3"}, "unknown dtype"},
		{nil, []string{"bench", "--local", "2", "--shape", "4x0x2"}, "--shape"},
		{nil, []string{"bench", "--local", "2", "--shape", "4x8", "--dim", "2"}, "--dim 2 is out of range"},
		{nil, []string{"bench", "--local", "2", "--max-bytes", "lots"}, "not a size in bytes"},
		{nil, []string{"bench", "--local", "2", "--op", "sideways"}, "--op"},
		{nil, []string{"bench", "--local", "2", "--padding", "mirror"}, `--padding: unknown padding "mirror" (want zeros, replicate, reflect or circular)`},
		{[]string{"HALO_BENCH_PADDING=wrap"}, []string{"bench", "--local", "2"}, `unknown padding "wrap"`},
		{nil, []string{"bench", "--local", "2", "--timeout", "soon"}, "not a duration"},
		{nil, []string{"bench", "--local", "2", "--plot", "x.gif"}, ".png"},
		{nil, []string{"bench", "--local", "2", "extra"}, "takes no arguments"},
		{nil, []string{"bench", "--local", "2", "--bind", "socket"}, "--bind"},
		{nil, []string{"bench", "--local", "2", "--json", "/dev/null/x.json"}, "--json /dev/null/x.json"},
		{[]string{"HALO_BENCH_DTYPE=int3"}, []string{"bench", "--local", "2"}, "unknown dtype"},
		{[]string{"HALO_BENCH_ITERS=many"}, []string{"bench", "--local", "2"}, "HALO_BENCH_ITERS"},
		{[]string{"HALO_TIMEOUT_MS=abc"}, []string{"bench", "--local", "1"}, `"abc" from environment variable "HALO_TIMEOUT_MS"`},
		{[]string{"HALO_BENCH_CHECK=maybe"}, []string{"bench", "--local", "2"}, `"maybe" from environment variable "HALO_BENCH_CHECK"`},
		{[]string{"RANK=5", "WORLD_SIZE=2"}, []string{"bench"}, "out of range"},
		{nil, []string{"serve", "--max-conns", "x"}, "max-conns"},
		{[]string{"HALO_MAX_CONNS=x"}, []string{"serve", "--insecure"}, "HALO_MAX_CONNS"},
		{nil, []string{"serve", "--insecure", "--max-conns", "-1"}, "--max-conns must be positive"},
		{nil, []string{"serve", "--listen", "127.0.0.1:0"}, "refusing to start without a token"},
		{nil, []string{"serve", "--insecure", "--listen", "0.0.0.0:0"}, "loopback addresses only"},
		{nil, []string{"serve", "--insecure", "--listen", "nonsense"}, "--listen"},
		{nil, []string{"serve", "--token-file", "/nonexistent/token"}, "--token-file"},
		{nil, []string{"--log-level", "loud", "info"}, "--log-level"},
		{nil, []string{"info", "--log-format", "xml"}, "--log-format"},
	} {
		r := halod(t, tc.env, tc.args...)
		if r.code != 2 {
			t.Errorf("halod %s (env %v): exit %d, want 2\nstderr: %s", strings.Join(tc.args, " "), tc.env, r.code, r.stderr)
			continue
		}
		if !strings.Contains(r.stderr, tc.want) || !strings.Contains(r.stderr, "--help") {
			t.Errorf("halod %s (env %v): stderr lacks %q or the hint:\n%s", strings.Join(tc.args, " "), tc.env, tc.want, r.stderr)
		}
		if r.stdout != "" {
			t.Errorf("halod %s: a usage error printed to stdout:\n%s", strings.Join(tc.args, " "), r.stdout)
		}
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	r := halod(t, nil, "version")
	if r.code != 0 || !strings.Contains(r.stdout, "halod 0.") || !strings.Contains(r.stdout, "UCX 1.") {
		t.Errorf("exit %d:\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := halod(t, nil, "--version"); r.code != 0 || !strings.Contains(r.stdout, "halod version 0.") {
		t.Errorf("--version: exit %d: %s", r.code, r.stdout)
	}
}

func TestInfo(t *testing.T) {
	t.Parallel()
	r := halod(t, []string{"UCX_TLS=shm,self", "HALO_TOKEN=hunter2", "HALO_JOB_ID=j7", "HALO_SPIN_POLLS=lots"}, "info")
	if r.code != 0 {
		t.Fatalf("exit %d: %s", r.code, r.stderr)
	}
	for _, want := range []string{"UCX      1.", "TRANSPORT", "self", "UCX_TLS", "shm,self", "UCX_NET_DEVICES", "HALO_RENDEZVOUS", "(unset)", "j7", "lane[", "Launcher: none",
		"HALO_TRANSFER", "(default " + comm.SettingTimeout.Default + ")", "lots (refused: not an integer)"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("halod info lacks %q:\n%s", want, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "hunter2") {
		t.Errorf("halod info shows the token:\n%s", r.stdout)
	}
	r = halod(t, []string{"RANK=1", "WORLD_SIZE=4"}, "info", "--json")
	var rep infoReport
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || r.code != 0 {
		t.Fatalf("info --json: exit %d, %v\n%s", r.code, err, r.stdout)
	}
	if len(rep.Resources) == 0 || rep.UCX == "" || rep.Launcher == nil || rep.Launcher.Rank != 1 || rep.Launcher.Size != 4 {
		t.Errorf("info --json: %+v", rep)
	}
}

// TestExitStatus checks the mapping from errors to statuses in-process.
func TestExitStatus(t *testing.T) {
	var buf bytes.Buffer
	for _, tc := range []struct {
		err  error
		code int
	}{
		{nil, 0},
		{&usageError{cmd: "halod bench", msg: "bad"}, 2},
		{&exitError{code: 3, err: io.EOF, logged: true}, 3},
		{io.EOF, 1},
	} {
		if got := exitStatus(tc.err, &buf); got != tc.code {
			t.Errorf("%v: status %d, want %d", tc.err, got, tc.code)
		}
	}
}
