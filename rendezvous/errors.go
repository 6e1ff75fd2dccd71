package rendezvous

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Code classifies a failure. It travels in ErrorReply and is kept in Error;
// a Code is itself an error, so callers can write
// errors.Is(err, rendezvous.CodeTimeout).
type Code uint8

// Values are part of the wire protocol: never renumber or reuse them.
const (
	// CodeBadRequest: a malformed message, or one sent out of turn.
	CodeBadRequest Code = 1
	// CodeUnauthorized: the token did not match the server's.
	CodeUnauthorized Code = 2
	// CodeVersion: the client speaks a protocol version the server does not.
	CodeVersion Code = 3
	// CodeTooLarge: a frame over the server's message size limit.
	CodeTooLarge Code = 4
	// CodeLimit: the job would exceed a server limit (jobs, keys or bytes).
	CodeLimit Code = 5
	// CodeBusy: the server is at its connection limit; clients retry.
	CodeBusy Code = 6
	// CodeMismatch: ranks of one job disagree (world size, rank, or two
	// different values written for one key).
	CodeMismatch Code = 7
	// CodeTimeout: what was waited for did not arrive in time.
	CodeTimeout Code = 8
	// CodeShuttingDown: the server is stopping; clients retry.
	CodeShuttingDown Code = 9
	// CodeAborted: the job was failed on purpose, e.g. by its hosting rank.
	CodeAborted Code = 10
	// CodeOtherJob: this server hosts another job (an embedded rendezvous
	// serves one job, attempt and launch); clients retry until their
	// deadline, since that job's rank 0 closes its server when done.
	CodeOtherJob Code = 11
	// CodeDuplicate: two processes claimed one rank of a job, or a rank
	// arrived for a job whose ranks had all met and still run (two runs
	// with the same job id and attempt).
	CodeDuplicate Code = 12
)

func (c Code) String() string {
	switch c {
	case CodeBadRequest:
		return "bad request"
	case CodeUnauthorized:
		return "unauthorized"
	case CodeVersion:
		return "unsupported protocol version"
	case CodeTooLarge:
		return "message too large"
	case CodeLimit:
		return "server limit reached"
	case CodeBusy:
		return "server busy"
	case CodeMismatch:
		return "ranks disagree"
	case CodeTimeout:
		return "timed out"
	case CodeShuttingDown:
		return "server shutting down"
	case CodeAborted:
		return "aborted"
	case CodeOtherJob:
		return "another job's server"
	case CodeDuplicate:
		return "rank claimed twice"
	}
	return "code " + strconv.Itoa(int(c))
}

// Error makes a Code usable with errors.Is.
func (c Code) Error() string { return "rendezvous: " + c.String() }

// retryable codes describe the server's state, not the job's: another
// connection a little later may well succeed.
func (c Code) retryable() bool { return c == CodeBusy || c == CodeShuttingDown || c == CodeOtherJob }

// Error is what Allgather and HostAllgather return. Its text names the job
// and attempt and says what went wrong in terms of ranks.
type Error struct {
	Code    Code // zero when the failure did not come with one (e.g. a cancelled context)
	Job     string
	Attempt string
	// Missing lists the ranks that did not arrive (or, from HostAllgather,
	// that did not collect the result), in increasing order.
	Missing []int
	Size    int
	Msg     string
	Err     error // the underlying cause, if any
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("rendezvous job ")
	b.WriteString(strconv.Quote(e.Job))
	if e.Attempt != "" {
		b.WriteString(" attempt ")
		b.WriteString(quoteIfNeeded(e.Attempt))
	}
	b.WriteString(": ")
	b.WriteString(e.Msg)
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

// Unwrap exposes both the Code and the cause to errors.Is and errors.As.
func (e *Error) Unwrap() []error {
	var errs []error
	if e.Code != 0 {
		errs = append(errs, e.Code)
	}
	if e.Err != nil {
		errs = append(errs, e.Err)
	}
	return errs
}

// quoteIfNeeded leaves plain attempt ids (numbers, nonces) bare and quotes
// anything else.
func quoteIfNeeded(s string) string {
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return strconv.Quote(s)
		}
	}
	return s
}

// rankList renders ranks as "rank 2" or "ranks 2, 3", eliding the middle of
// long lists so that an error about a 4096-rank job stays readable.
func rankList(ranks []int) string {
	const show = 16
	word := "ranks "
	if len(ranks) == 1 {
		word = "rank "
	}
	var b strings.Builder
	b.WriteString(word)
	for i, r := range ranks {
		if i == show-2 && len(ranks) > show {
			fmt.Fprintf(&b, ", ... (%d more), %d", len(ranks)-show+1, ranks[len(ranks)-1])
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(r))
	}
	return b.String()
}

// roundDuration keeps durations in messages short ("10s", "1.5s", "300ms").
func roundDuration(d time.Duration) time.Duration {
	switch {
	case d >= 10*time.Second:
		return d.Round(time.Second)
	case d >= time.Second:
		return d.Round(100 * time.Millisecond)
	}
	return d.Round(time.Millisecond)
}

// ErrServerClosed is returned by Serve and ListenAndServe after Shutdown.
var ErrServerClosed = errors.New("rendezvous: server closed")

// errUIDUnsupported: this system does not say who owns a peer's socket.
var errUIDUnsupported = errors.New("rendezvous: the owner of a peer's socket is unknown on this system")
