package comm

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/ucx"
)

// Kind is how a setting's value is written, and so which parser reads it.
type Kind int

const (
	KindString     Kind = iota // taken as it is
	KindBool                   // ParseBool
	KindInt                    // ParseInt
	KindDuration               // ParseDuration
	KindTransfer               // ParseTransfer
	KindCUDADriver             // ParseCUDADriver
)

// Setting is one HALO_* environment variable the library reads. halod's
// flags that stand for the same thing take the name and default from here,
// and the README's configuration table and include/halo.h are checked
// against this table by a test.
type Setting struct {
	Env  string
	Kind Kind
	// Default is what an unset (or empty) variable means, written as the
	// variable would be; "" is no value.
	Default string
	Means   string
}

// The library's settings. A Config field that is zero takes the variable,
// else the default.
var (
	SettingRendezvous = Setting{Env: "HALO_RENDEZVOUS", Kind: KindString, Default: DefaultRendezvous,
		Means: "where ranks meet: host:port of rank 0, which hosts the rendezvous, or of a halod serve"}
	SettingRendezvousExternal = Setting{Env: "HALO_RENDEZVOUS_EXTERNAL", Kind: KindBool, Default: "off",
		Means: "the rendezvous is a shared halod serve: rank 0 does not host one"}
	SettingToken = Setting{Env: "HALO_TOKEN", Kind: KindString,
		Means: "shared secret of the rendezvous; required when it is not on loopback (without one, only the rendezvous's own user may join)"}
	SettingJobID = Setting{Env: "HALO_JOB_ID", Kind: KindString, Default: "halo",
		Means: "names the job: ranks meet only ranks of the same job id, attempt and launch"}
	SettingJobAttempt = Setting{Env: "HALO_JOB_ATTEMPT", Kind: KindString,
		Means: "names one run of the job: give a restart a new one, so that it never sees the old run's addresses"}
	SettingTimeout = Setting{Env: "HALO_TIMEOUT_MS", Kind: KindDuration, Default: FormatDuration(halo.DefaultTimeout),
		Means: "deadline of every wait in plan create, forward and backward"}
	SettingBootstrapTimeout = Setting{Env: "HALO_BOOTSTRAP_TIMEOUT_MS", Kind: KindDuration, Default: "1m",
		Means: "deadline of the rendezvous"}
	SettingDetectPeerFailure = Setting{Env: "HALO_DETECT_PEER_FAILURE", Kind: KindBool, Default: "off",
		Means: "UCX peer error handling as well (its keepalive also finds a peer whose host is gone), at the cost of single-copy large messages; a dead process is found without it"}
	SettingSpinPolls = Setting{Env: "HALO_SPIN_POLLS", Kind: KindInt, Default: strconv.Itoa(ucx.DefaultSpinPolls),
		Means: "polls before a waiting rank yields its CPU (lower it when ranks outnumber CPUs; negative never yields)"}
	SettingTransfer = Setting{Env: "HALO_TRANSFER", Kind: KindTransfer, Default: "auto",
		Means: "how strided halos go on the wire: auto, pack (copied into a buffer) or iov (UCX IOV)"}
	SettingCUDADriver = Setting{Env: "HALO_CUDA_DRIVER", Kind: KindCUDADriver, Default: "cuda",
		Means: "the CUDA driver of stream-ordered exchanges: cuda (libcuda.so.1, loaded on first use) or host-fake (a host emulation, for tests without a GPU)"}
)

// Settings lists every library setting, in the order halod info shows them.
var Settings = []Setting{
	SettingRendezvous, SettingRendezvousExternal, SettingToken, SettingJobID, SettingJobAttempt,
	SettingTimeout, SettingBootstrapTimeout, SettingDetectPeerFailure, SettingSpinPolls, SettingTransfer,
	SettingCUDADriver,
}

// SettingValue is the setting named env as the library reads it now (the
// environment through Getenv, else the default): as text, and as a number
// where it is one (milliseconds for a duration, 0 or 1 for a switch, the
// integer for a count; else 0). For bindings, which must not parse settings
// by rules of their own.
func SettingValue(env string) (text string, number int64, err error) {
	i := slices.IndexFunc(Settings, func(s Setting) bool { return s.Env == env })
	if i < 0 {
		return "", 0, fmt.Errorf("%w: %q is not a setting of halo %s (see the README's configuration table)", halo.ErrInvalid, env, halo.Version)
	}
	s := Settings[i]
	text = Getenv(s.Env)
	if text == "" {
		text = s.Default
	}
	bad := func(err error) (string, int64, error) {
		return "", 0, fmt.Errorf("%w: %s=%q: %v", halo.ErrInvalid, s.Env, text, err)
	}
	switch s.Kind {
	case KindDuration:
		d, err := ParseDuration(text)
		if err != nil {
			return bad(err)
		}
		number = d.Milliseconds()
	case KindBool:
		b, err := ParseBool(text)
		if err != nil {
			return bad(err)
		}
		if b {
			number = 1
		}
	case KindInt:
		n, err := ParseInt(text)
		if err != nil {
			return bad(err)
		}
		number = int64(n)
	default:
		if err := s.Check(text); err != nil {
			return bad(err)
		}
	}
	return text, number, nil
}

// Check says whether v is a value of the setting's kind.
func (s Setting) Check(v string) error {
	var err error
	switch s.Kind {
	case KindBool:
		_, err = ParseBool(v)
	case KindInt:
		_, err = ParseInt(v)
	case KindDuration:
		_, err = ParseDuration(v)
	case KindTransfer:
		_, err = ParseTransfer(v)
	case KindCUDADriver:
		_, err = ParseCUDADriver(v)
	}
	return err
}

// Getenv reads the process environment. Go copies the environment when its
// runtime starts, so in libhalo.so (loaded into a Python or C++ process that
// may set variables afterwards, as `os.environ[...] = ...` does) os.Getenv
// would miss every later change; capi points this at the C library's
// getenv, so settings are read as the process sees them when a
// communicator is made.
var Getenv = os.Getenv

// lookup reads s from the environment through parse; unset or empty
// gives the default.
func lookup[T any](s Setting, parse func(string) (T, error)) (T, error) {
	v := Getenv(s.Env)
	if v == "" {
		v = s.Default
	}
	x, err := parse(v)
	if err != nil {
		return x, fmt.Errorf("%w: %s=%q: %v", halo.ErrInvalid, s.Env, v, err)
	}
	return x, nil
}

func parseString(s string) (string, error) { return s, nil }

// MaxDuration is the longest duration a setting takes: 2^40 ms, the bound
// the C API puts on its *_ms parameters, far from time.Duration's overflow.
const MaxDuration = (1 << 40) * time.Millisecond

// ParseDuration reads a positive duration of at most MaxDuration: a Go
// duration (500ms, 2s, 1m) or a bare number of milliseconds, as the *_MS
// variables have always been written.
func ParseDuration(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	tooLong := errors.New("longer than 2^40 ms")
	var d time.Duration
	ms, err := strconv.ParseInt(s, 10, 64)
	switch {
	case err == nil && ms > int64(MaxDuration/time.Millisecond):
		// Refused before multiplying: 2^58+1 ms would wrap around to 1 ms.
		return 0, tooLong
	case err == nil:
		d = time.Duration(ms) * time.Millisecond
	case errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(s, "-"):
		return 0, tooLong
	case errors.Is(err, strconv.ErrRange):
		return 0, errors.New("must be positive")
	default:
		if d, err = time.ParseDuration(s); err != nil {
			return 0, errors.New("not a duration (examples: 5000 for milliseconds, 500ms, 2s, 1m)")
		}
	}
	switch {
	case d <= 0:
		return 0, errors.New("must be positive")
	case d > MaxDuration:
		return 0, tooLong
	}
	return d, nil
}

// FormatDuration writes d in its largest whole unit (2m, 30s, 500ms), a
// form ParseDuration reads back.
func FormatDuration(d time.Duration) string {
	for _, u := range []struct {
		d    time.Duration
		name string
	}{{time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}, {time.Millisecond, "ms"}} {
		if d != 0 && d%u.d == 0 {
			return strconv.FormatInt(int64(d/u.d), 10) + u.name
		}
	}
	return d.String()
}

// ParseBool reads 1, true, yes, on and 0, false, no, off, in any case.
func ParseBool(s string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "1", "true", "yes", "on":
		return true, nil
	case "0", "false", "no", "off":
		return false, nil
	}
	return false, errors.New("not a boolean (want 1, true, yes, on or 0, false, no, off)")
}

// ParseInt reads a decimal integer.
func ParseInt(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, errors.New("not an integer")
	}
	return n, nil
}

// ParseTransfer reads auto, pack or iov, in any case.
// ParseCUDADriver reads SettingCUDADriver: which driver stream-ordered
// exchanges load (package cuda).
func ParseCUDADriver(s string) (string, error) {
	switch v := strings.ToLower(strings.TrimSpace(s)); v {
	case "cuda", "host-fake":
		return v, nil
	}
	return "", errors.New("want cuda or host-fake")
}

func ParseTransfer(s string) (halo.Transfer, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "auto":
		return halo.TransferAuto, nil
	case "pack":
		return halo.TransferPack, nil
	case "iov":
		return halo.TransferIOV, nil
	}
	return 0, errors.New("want auto, pack or iov")
}
