package comm

import (
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/halo-cp/halo/halo"
)

// clearSettings unsets every library setting (empty means unset), so that
// the developer's environment cannot change what a test sees.
func clearSettings(t *testing.T) {
	for _, s := range Settings {
		t.Setenv(s.Env, "")
	}
}

func TestParseDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"5000": 5 * time.Second, " 250 ": 250 * time.Millisecond, "500ms": 500 * time.Millisecond,
		"2s": 2 * time.Second, "1m": time.Minute, "1.5s": 1500 * time.Millisecond, "1": time.Millisecond,
		"1099511627776": MaxDuration, "1099511627776ms": MaxDuration,
	} {
		if got, err := ParseDuration(in); err != nil || got != want {
			t.Errorf("ParseDuration(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for in, why := range map[string]string{
		"": "not a duration", "abc": "not a duration", "5 s": "not a duration", "1.5": "not a duration",
		"0": "positive", "0s": "positive", "-1": "positive", "-2s": "positive", "-99999999999999999999": "positive",
		"1099511627777": "2^40", "1099511627777ms": "2^40", "288230376151711745": "2^40",
		"9223372036854775807": "2^40", "99999999999999999999": "2^40",
	} {
		if got, err := ParseDuration(in); err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("ParseDuration(%q) = %v, %v; want an error saying %q", in, got, err, why)
		}
	}
	for _, d := range []time.Duration{halo.DefaultTimeout, time.Hour, 30 * time.Second, 300 * time.Millisecond, 1500 * time.Microsecond} {
		if got, err := ParseDuration(FormatDuration(d)); err != nil || got != d {
			t.Errorf("FormatDuration(%v) = %q reads back as %v, %v", d, FormatDuration(d), got, err)
		}
	}
}

func TestParseBool(t *testing.T) {
	for in, want := range map[string]bool{
		"1": true, "true": true, "TRUE": true, "yes": true, "Yes": true, "on": true, " ON ": true,
		"0": false, "false": false, "False": false, "no": false, "NO": false, "off": false, "Off": false,
	} {
		if got, err := ParseBool(in); err != nil || got != want {
			t.Errorf("ParseBool(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "2", "t", "f", "y", "n", "enable", "truee", "-1"} {
		if got, err := ParseBool(in); err == nil {
			t.Errorf("ParseBool(%q) = %v, want an error", in, got)
		}
	}
}

func TestParseInt(t *testing.T) {
	for in, want := range map[string]int{"0": 0, "256": 256, " 7 ": 7, "-1": -1, "+3": 3} {
		if got, err := ParseInt(in); err != nil || got != want {
			t.Errorf("ParseInt(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "x", "1.5", "1e3", "0x10", "99999999999999999999"} {
		if got, err := ParseInt(in); err == nil {
			t.Errorf("ParseInt(%q) = %v, want an error", in, got)
		}
	}
}

func TestParseTransfer(t *testing.T) {
	for in, want := range map[string]halo.Transfer{
		"auto": halo.TransferAuto, "pack": halo.TransferPack, "iov": halo.TransferIOV, "PACK": halo.TransferPack, " Iov ": halo.TransferIOV,
	} {
		if got, err := ParseTransfer(in); err != nil || got != want {
			t.Errorf("ParseTransfer(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "zip", "packed", "0"} {
		if got, err := ParseTransfer(in); err == nil {
			t.Errorf("ParseTransfer(%q) = %v, want an error", in, got)
		}
	}
}

func TestSettingsTable(t *testing.T) {
	seen := map[string]bool{}
	for _, s := range Settings {
		if !strings.HasPrefix(s.Env, "HALO_") || seen[s.Env] {
			t.Errorf("%s: not a HALO_ variable, or listed twice", s.Env)
		}
		seen[s.Env] = true
		if s.Means == "" {
			t.Errorf("%s says nothing of what it means", s.Env)
		}
		// Unset variables are read as their default, by the same parser.
		if err := s.Check(s.Default); err != nil {
			t.Errorf("%s: default %q: %v", s.Env, s.Default, err)
		}
	}
}

// fill runs Config.fill, which New runs first, without opening UCX.
func fill(t *testing.T, c Config) (Config, error) {
	t.Helper()
	if c.Size == 0 {
		c.Size = 1
	}
	err := c.fill()
	return c, err
}

// Every setting reaches the configuration, and a bad value of every kind
// that can be wrong fails it with the variable and the value named.
func TestEverySettingReachesConfig(t *testing.T) {
	clearSettings(t)
	c, err := fill(t, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if c.Rendezvous != DefaultRendezvous || c.Job != "halo" || c.Timeout != halo.DefaultTimeout || c.BootstrapTimeout != time.Minute ||
		c.Transfer != halo.TransferAuto || c.ExternalServer || c.DetectPeerFailure || c.Token != "" || c.Attempt != "" {
		t.Errorf("defaults: %+v", c)
	}
	cases := map[string]struct {
		value, bad string
		ok         func(Config) bool
	}{
		SettingRendezvous.Env:         {"10.0.0.1:1234", "", func(c Config) bool { return c.Rendezvous == "10.0.0.1:1234" }},
		SettingRendezvousExternal.Env: {"true", "maybe", func(c Config) bool { return c.ExternalServer }},
		SettingToken.Env:              {"s3cret", "", func(c Config) bool { return c.Token == "s3cret" }},
		SettingJobID.Env:              {"j7", "", func(c Config) bool { return c.Job == "j7" }},
		SettingJobAttempt.Env:         {"3", "", func(c Config) bool { return c.Attempt == "3" }},
		SettingTimeout.Env:            {"2s", "soon", func(c Config) bool { return c.Timeout == 2*time.Second }},
		SettingBootstrapTimeout.Env:   {"5000", "0", func(c Config) bool { return c.BootstrapTimeout == 5*time.Second }},
		SettingDetectPeerFailure.Env:  {"on", "2", func(c Config) bool { return c.DetectPeerFailure }},
		SettingSpinPolls.Env:          {"256", "lots", func(c Config) bool { return c.SpinPolls == 256 }},
		SettingTransfer.Env:           {"pack", "zip", func(c Config) bool { return c.Transfer == halo.TransferPack }},
		SettingCUDADriver.Env:         {"host-fake", "gpu", func(c Config) bool { return c.CUDADriver == "host-fake" }},
	}
	for _, s := range Settings {
		tc, ok := cases[s.Env]
		if !ok {
			t.Errorf("%s is not tested here", s.Env)
			continue
		}
		t.Run(s.Env, func(t *testing.T) {
			t.Setenv(s.Env, tc.value)
			if c, err := fill(t, Config{}); err != nil || !tc.ok(c) {
				t.Errorf("%s=%s: %v, config %+v", s.Env, tc.value, err, c)
			}
			if tc.bad == "" {
				return
			}
			t.Setenv(s.Env, tc.bad)
			_, err := fill(t, Config{})
			if !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), s.Env+`="`+tc.bad+`"`) {
				t.Errorf("%s=%s: got %v, want an invalid-argument error naming the variable and the value", s.Env, tc.bad, err)
			}
		})
	}
}

func TestFieldsWinOverSettings(t *testing.T) {
	clearSettings(t)
	t.Setenv(SettingTimeout.Env, "5000")
	t.Setenv(SettingTransfer.Env, "pack")
	t.Setenv(SettingJobID.Env, "from-env")
	c, err := fill(t, Config{Timeout: 3 * time.Second, Transfer: halo.TransferIOV, Job: "mine"})
	if err != nil || c.Timeout != 3*time.Second || c.Transfer != halo.TransferIOV || c.Job != "mine" {
		t.Errorf("%v: %+v", err, c)
	}
}

// 2^58+1 ms used to wrap around to a 1 ms deadline; the C parameters stop
// at 2^40 ms, and so does the variable now.
func TestTimeoutOverflow(t *testing.T) {
	clearSettings(t)
	t.Setenv(SettingTimeout.Env, "288230376151711745")
	c, err := fill(t, Config{})
	if !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), "HALO_TIMEOUT_MS") || !strings.Contains(err.Error(), "2^40") {
		t.Errorf("got %v (timeout %v), want an error naming HALO_TIMEOUT_MS and the 2^40 ms bound", err, c.Timeout)
	}
	t.Setenv(SettingTimeout.Env, "1099511627776")
	if c, err := fill(t, Config{}); err != nil || c.Timeout != MaxDuration {
		t.Errorf("2^40 ms: %v, %v", c.Timeout, err)
	}
}

// readmeTable returns the rows of README.md's configuration table by the
// HALO_ variable they name.
func readmeTable(t *testing.T) map[string][]string {
	t.Helper()
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, sec, ok := strings.Cut(string(b), "\n## Configuration\n")
	if !ok {
		t.Fatal("README.md has no section ## Configuration")
	}
	sec, _, _ = strings.Cut(sec, "\n## ")
	rows := map[string][]string{}
	variable := regexp.MustCompile(`HALO_[A-Z0-9_]+`)
	for _, line := range strings.Split(sec, "\n") {
		if !strings.HasPrefix(line, "|") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		names := variable.FindAllString(cells[0], -1)
		if len(names) > 1 || len(names) == 1 && cells[0] != "`"+names[0]+"`" {
			t.Errorf("README.md configuration row %q: give each HALO_ variable a row, named alone", line)
		}
		for _, n := range names {
			rows[n] = cells
		}
	}
	return rows
}

// The README's configuration table and the header's halo_comm_params_t
// comment say what this table says.
func TestDocumentsAgreeWithSettings(t *testing.T) {
	rows := readmeTable(t)
	known := map[string]bool{}
	for _, s := range Settings {
		known[s.Env] = true
		row, ok := rows[s.Env]
		if !ok {
			t.Errorf("README.md's configuration table lacks %s", s.Env)
			continue
		}
		want := "none"
		if s.Default != "" {
			want = "`" + s.Default + "`"
		}
		if len(row) != 3 || !strings.HasPrefix(row[2], want) {
			t.Errorf("README.md: %s's default is %q there, the library's is %s", s.Env, row[len(row)-1], want)
		}
	}
	for n := range rows {
		if !known[n] {
			t.Errorf("README.md's configuration table lists %s, which the library does not read (comm.Settings)", n)
		}
	}

	b, err := os.ReadFile("../include/halo.h")
	if err != nil {
		t.Fatal(err)
	}
	h := string(b)
	end := strings.Index(h, "typedef struct halo_comm_params {")
	start := strings.LastIndex(h[:max(end, 0)], "/**")
	if end < 0 || start < 0 {
		t.Fatal("include/halo.h: no doc comment before typedef struct halo_comm_params")
	}
	named := map[string]bool{}
	for _, n := range regexp.MustCompile(`HALO_[A-Z0-9_]+`).FindAllString(h[start:end], -1) {
		named[n] = true
	}
	for _, s := range Settings {
		if !named[s.Env] {
			t.Errorf("include/halo.h: the comment of halo_comm_params_t does not name %s, which halo_comm_create reads", s.Env)
		}
	}
}

// SettingValue is what bindings read instead of parsing a setting
// themselves: the environment (through Getenv, as a communicator reads
// it), else the default; as text and number; a refused value named.
func TestSettingValue(t *testing.T) {
	env := map[string]string{}
	old := Getenv
	Getenv = func(k string) string { return env[k] }
	t.Cleanup(func() { Getenv = old })
	for _, c := range []struct {
		name, value, text string
		number            int64
	}{
		{"HALO_BOOTSTRAP_TIMEOUT_MS", "", "1m", 60000},
		{"HALO_BOOTSTRAP_TIMEOUT_MS", "1500", "1500", 1500},
		{"HALO_BOOTSTRAP_TIMEOUT_MS", "2s", "2s", 2000},
		{"HALO_DETECT_PEER_FAILURE", "on", "on", 1},
		{"HALO_SPIN_POLLS", "-1", "-1", -1},
		{"HALO_TRANSFER", "iov", "iov", 0},
	} {
		env = map[string]string{c.name: c.value}
		text, n, err := SettingValue(c.name)
		if err != nil || text != c.text || n != c.number {
			t.Errorf("%s=%q: got %q, %d, %v; want %q, %d", c.name, c.value, text, n, err, c.text, c.number)
		}
	}
	env = map[string]string{"HALO_BOOTSTRAP_TIMEOUT_MS": "banana"}
	if _, _, err := SettingValue("HALO_BOOTSTRAP_TIMEOUT_MS"); !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), `HALO_BOOTSTRAP_TIMEOUT_MS="banana"`) {
		t.Errorf("a bad value: %v", err)
	}
	if _, _, err := SettingValue("HALO_NO_SUCH"); !errors.Is(err, halo.ErrInvalid) || !strings.Contains(err.Error(), "HALO_NO_SUCH") {
		t.Errorf("an unknown name: %v", err)
	}
}
