package cli

import (
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/halo-cp/halo/comm"
	ucli "github.com/urfave/cli/v2"
)

// byteSize is a flag value in bytes that people can type as 8, 2K, 2KiB,
// 1M or 256MiB. K, M and G are binary (1024) multiples, as in nccl-tests'
// -b/-e; "KB"-style suffixes mean the same.
type byteSize int64

func parseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	u := strings.ToUpper(t)
	mult := int64(1)
	for _, suf := range []struct {
		s string
		m int64
	}{
		{"GIB", 1 << 30}, {"MIB", 1 << 20}, {"KIB", 1 << 10},
		{"GB", 1 << 30}, {"MB", 1 << 20}, {"KB", 1 << 10},
		{"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1},
	} {
		if strings.HasSuffix(u, suf.s) {
			u, mult = strings.TrimSpace(strings.TrimSuffix(u, suf.s)), suf.m
			break
		}
	}
	n, err := strconv.ParseInt(u, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("%q is not a size in bytes (examples: 8, 2K, 2KiB, 256M)", s)
	}
	return n * mult, nil
}

func (b *byteSize) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b = byteSize(n)
	return nil
}

func (b *byteSize) String() string { return formatBytes(int64(*b)) }

// formatBytes prints n exactly, with a binary suffix when it is a multiple.
func formatBytes(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return strconv.FormatInt(n>>30, 10) + "GiB"
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatInt(n>>20, 10) + "MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatInt(n>>10, 10) + "KiB"
	}
	return strconv.FormatInt(n, 10) + "B"
}

// millis is a duration flag read by the library's parser
// (comm.ParseDuration): a bare number is milliseconds, so that a flag can
// share a *_MS variable with the library and still take --timeout 5s.
// Every halod duration is one, so that they all read alike.
type millis time.Duration

func (m *millis) Set(s string) error {
	d, err := comm.ParseDuration(s)
	if err != nil {
		return err
	}
	*m = millis(d)
	return nil
}

func (m *millis) String() string { return comm.FormatDuration(time.Duration(*m)) }

// settingMillis is the default of a flag that stands for a library
// duration setting: the table's, so that it is stated once.
func settingMillis(s comm.Setting) *millis {
	var m millis
	if err := m.Set(s.Default); err != nil {
		panic(fmt.Sprintf("%s: default %q: %v", s.Env, s.Default, err)) // comm's tests rule this out
	}
	return &m
}

func duration(c *ucli.Context, name string) time.Duration {
	return time.Duration(*c.Generic(name).(*millis))
}

// transfer is --transfer, read by the library's parser; it keeps the name.
type transfer string

func (t *transfer) Set(s string) error {
	if _, err := comm.ParseTransfer(s); err != nil {
		return err
	}
	*t = transfer(strings.ToLower(strings.TrimSpace(s)))
	return nil
}

func (t *transfer) String() string { return string(*t) }

// boolFlag is a BoolFlag whose variable is read by the library's parser
// (comm.ParseBool: 1/true/yes/on, 0/false/no/off; empty is unset) instead
// of strconv.ParseBool, which lacks yes/on/no/off.
type boolFlag struct{ *ucli.BoolFlag }

func (f boolFlag) Apply(set *flag.FlagSet) error {
	// The variable becomes the value the command line starts from, as
	// urfave does it; f keeps its own default for the help.
	plain := *f.BoolFlag
	plain.EnvVars = nil
	for _, env := range f.EnvVars {
		v := os.Getenv(env)
		if v == "" {
			continue
		}
		b, err := comm.ParseBool(v)
		if err != nil {
			// Worded as urfave words its own, which flagMessage rewords.
			return fmt.Errorf("could not parse %q from environment variable %q as value for flag %s: %v", v, env, f.Name, err)
		}
		plain.Value = b
		f.HasBeenSet = true // for IsSet
		break
	}
	return plain.Apply(set)
}
