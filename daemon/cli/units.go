package cli

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
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

// millis is a duration flag that also accepts a bare number of
// milliseconds, so that it can share an environment variable with the
// library (HALO_TIMEOUT_MS=5000) and still take --timeout 5s.
type millis time.Duration

func (m *millis) Set(s string) error {
	s = strings.TrimSpace(s)
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		if n < 0 {
			return fmt.Errorf("%q is negative", s)
		}
		*m = millis(time.Duration(n) * time.Millisecond)
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return fmt.Errorf("%q is not a duration (examples: 5000 for milliseconds, 5s, 2m)", s)
	}
	*m = millis(d)
	return nil
}

func (m *millis) String() string { return time.Duration(*m).String() }
