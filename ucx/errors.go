package ucx

/*
#include "helpers.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors, for errors.Is. Errors returned by this package wrap them
// where they apply; a *StatusError matches the one its status stands for.
var (
	// ErrTimeout: the deadline passed while operations were pending.
	ErrTimeout = errors.New("ucx: deadline passed")
	// ErrPeerFailed: an endpoint failed (peer dead, unreachable, or the
	// endpoint closed after an earlier failure).
	ErrPeerFailed = errors.New("ucx: peer failed")
	// ErrMessageLength: a received message was longer or shorter than the
	// receive's segments (see *LengthError for expected and got).
	ErrMessageLength = errors.New("ucx: received length differs from expected")
	// ErrClosed: the transport or batch is closed.
	ErrClosed = errors.New("ucx: closed")
	// ErrAborted: Transport.Abort was called.
	ErrAborted = errors.New("ucx: aborted")
	// ErrMemoryType: an operation's memory is of a type this UCX cannot move.
	ErrMemoryType = errors.New("ucx: memory type not supported")
	// ErrInterrupted: a SIGINT came while a long Wait slept; the transport
	// is aborted, as by Abort, and matches ErrAborted too.
	ErrInterrupted = &interrupted{}
)

type interrupted struct{}

func (*interrupted) Error() string {
	return "ucx: interrupted by SIGINT during a wait (the transport was aborted and its peers told)"
}
func (*interrupted) Is(target error) bool { return target == ErrAborted }

// Status is a UCX status code (ucs_status_t): 0 is success, negative values
// are errors.
type Status int32

// Status values, bound to ucs/type/status.h's so that they cannot drift.
const (
	StatusOK               Status = C.UCS_OK
	StatusInProgress       Status = C.UCS_INPROGRESS
	StatusNoMessage        Status = C.UCS_ERR_NO_MESSAGE
	StatusNoResource       Status = C.UCS_ERR_NO_RESOURCE
	StatusIOError          Status = C.UCS_ERR_IO_ERROR
	StatusNoMemory         Status = C.UCS_ERR_NO_MEMORY
	StatusInvalidParam     Status = C.UCS_ERR_INVALID_PARAM
	StatusUnreachable      Status = C.UCS_ERR_UNREACHABLE
	StatusInvalidAddr      Status = C.UCS_ERR_INVALID_ADDR
	StatusNotImplemented   Status = C.UCS_ERR_NOT_IMPLEMENTED
	StatusMessageTruncated Status = C.UCS_ERR_MESSAGE_TRUNCATED
	StatusNoProgress       Status = C.UCS_ERR_NO_PROGRESS
	StatusBufferTooSmall   Status = C.UCS_ERR_BUFFER_TOO_SMALL
	StatusNoElem           Status = C.UCS_ERR_NO_ELEM
	StatusNoDevice         Status = C.UCS_ERR_NO_DEVICE
	StatusBusy             Status = C.UCS_ERR_BUSY
	StatusCanceled         Status = C.UCS_ERR_CANCELED
	StatusShmemSegment     Status = C.UCS_ERR_SHMEM_SEGMENT
	StatusAlreadyExists    Status = C.UCS_ERR_ALREADY_EXISTS
	StatusOutOfRange       Status = C.UCS_ERR_OUT_OF_RANGE
	StatusTimedOut         Status = C.UCS_ERR_TIMED_OUT
	StatusExceedsLimit     Status = C.UCS_ERR_EXCEEDS_LIMIT
	StatusUnsupported      Status = C.UCS_ERR_UNSUPPORTED
	StatusRejected         Status = C.UCS_ERR_REJECTED
	StatusNotConnected     Status = C.UCS_ERR_NOT_CONNECTED
	StatusConnectionReset  Status = C.UCS_ERR_CONNECTION_RESET
	StatusEndpointTimeout  Status = C.UCS_ERR_ENDPOINT_TIMEOUT
)

// Statuses of a peer that said goodbye (helpers.h): never UCX's own.
const (
	StatusPeerClosed  Status = C.HUX_ERR_PEER_CLOSED
	StatusPeerAborted Status = C.HUX_ERR_PEER_ABORTED
	// StatusPeerGone: the peer's process ended without a goodbye
	// (Transport.PeerGone).
	StatusPeerGone Status = C.HUX_ERR_PEER_GONE
)

// String is UCX's text for the status (ucs_status_string).
func (s Status) String() string {
	switch s {
	case StatusPeerClosed:
		return "the peer destroyed its communicator"
	case StatusPeerAborted:
		return "the peer aborted its communicator"
	case StatusPeerGone:
		return "the peer's process ended"
	}
	return C.GoString(C.ucs_status_string(C.ucs_status_t(s)))
}

// peerFailure reports whether the status means the other side is gone.
func (s Status) peerFailure() bool {
	switch s {
	case StatusIOError, StatusUnreachable, StatusNotConnected,
		StatusConnectionReset, StatusRejected:
		return true
	}
	// UCS_ERR_FIRST_LINK_FAILURE .. UCS_ERR_LAST_ENDPOINT_FAILURE, which
	// includes UCS_ERR_ENDPOINT_TIMEOUT.
	return s <= C.UCS_ERR_FIRST_LINK_FAILURE && s >= C.UCS_ERR_LAST_ENDPOINT_FAILURE
}

// StatusError is a UCX call that returned an error status.
type StatusError struct {
	Func   string // the UCX function, or what was being done
	Status Status
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("ucx: %s: %s (status %d)", e.Func, e.Status, int32(e.Status))
}

// Is matches the sentinel the status stands for: ErrPeerFailed,
// ErrMessageLength (UCS_ERR_MESSAGE_TRUNCATED) or ErrTimeout
// (UCS_ERR_TIMED_OUT).
func (e *StatusError) Is(target error) bool {
	switch target {
	case ErrPeerFailed:
		return e.Status.peerFailure()
	case ErrMessageLength:
		return e.Status == StatusMessageTruncated
	case ErrTimeout:
		return e.Status == StatusTimedOut
	}
	return false
}

func statusError(fn string, s C.ucs_status_t) error {
	if s == C.UCS_OK {
		return nil
	}
	return &StatusError{Func: fn, Status: Status(s)}
}

// LengthError is a received message whose length is not the total of the
// receive's segments. UCX itself reports only messages that are too long.
type LengthError struct {
	Expected int64
	Got      int64
}

func (e *LengthError) Error() string {
	return fmt.Sprintf("ucx: received %d bytes, expected %d", e.Got, e.Expected)
}

// Is matches ErrMessageLength.
func (e *LengthError) Is(target error) bool { return target == ErrMessageLength }

// PeerError is an operation that could not complete because its peer's
// endpoint failed (Status is what UCX reported for the endpoint) or was
// force-closed after an earlier failure.
type PeerError struct {
	Rank   int
	Status Status
	// Cause is, for StatusPeerAborted, the rank whose death made the peer
	// abort (Transport.AbortFor), or -1.
	Cause int
}

func (e *PeerError) Error() string {
	switch e.Status {
	case StatusPeerClosed:
		return fmt.Sprintf("ucx: rank %d destroyed its communicator", e.Rank)
	case StatusPeerAborted:
		if e.Cause >= 0 {
			return fmt.Sprintf("ucx: rank %d aborted its communicator: rank %d's process ended (its exchanges in flight are void)", e.Rank, e.Cause)
		}
		return fmt.Sprintf("ucx: rank %d aborted its communicator (its exchanges in flight are void)", e.Rank)
	case StatusPeerGone:
		return fmt.Sprintf("ucx: rank %d's process ended without destroying its communicator (killed, crashed or exited; its liveness link closed)", e.Rank)
	}
	if e.Status == StatusCanceled {
		return fmt.Sprintf("ucx: endpoint to rank %d was closed after an earlier failure", e.Rank)
	}
	return fmt.Sprintf("ucx: endpoint to rank %d failed: %s", e.Rank, e.Status)
}

// Is matches ErrPeerFailed.
func (e *PeerError) Is(target error) bool { return target == ErrPeerFailed }

// ConnectError is an endpoint to Rank that UCX could not create. Detail is
// the first error line UCX logged meanwhile (it is kept off stderr). When the
// status says the peer is not there (its shared memory is gone, it cannot be
// reached) it matches ErrPeerFailed: the rank has ended since it handed out
// its address.
type ConnectError struct {
	Rank   int
	Status Status
	Detail string
}

// gone reports whether the failure means the peer is not there: a shared
// memory segment that cannot be attached belongs to a process that ended
// (UCX attaches only segments of processes it can reach), or UCX's own
// peer-failure statuses.
func (e *ConnectError) gone() bool {
	return e.Status == StatusShmemSegment || e.Status.peerFailure()
}

func (e *ConnectError) Error() string {
	var what string
	switch {
	case e.Status == StatusShmemSegment:
		what = fmt.Sprintf("ucx: connect to rank %d: the rank is gone: its shared memory can no longer be attached (its process ended after giving its address): %s", e.Rank, e.Status)
	case e.gone():
		what = fmt.Sprintf("ucx: connect to rank %d: the rank cannot be reached: %s", e.Rank, e.Status)
	default:
		what = fmt.Sprintf("ucx: connect to rank %d: ucp_ep_create: %s", e.Rank, e.Status)
	}
	if e.Detail != "" {
		what += " (" + e.Detail + ")"
	}
	return what
}

// Is matches ErrPeerFailed when the peer is gone.
func (e *ConnectError) Is(target error) bool { return target == ErrPeerFailed && e.gone() }

// Unwrap exposes the status, as a *StatusError, to errors.As.
func (e *ConnectError) Unwrap() error { return &StatusError{Func: "ucp_ep_create", Status: e.Status} }

// OpError is one operation of a batch that failed or was still pending.
type OpError struct {
	Peer  int
	Tag   uint64
	Send  bool
	Bytes int64
	Err   error
}

// Op describes the operation as "recv from rank 1 (tag 0x2a, 2048 bytes)".
func (e *OpError) Op() string {
	if e.Send {
		return fmt.Sprintf("send to rank %d (tag %#x, %d bytes)", e.Peer, e.Tag, e.Bytes)
	}
	return fmt.Sprintf("recv from rank %d (tag %#x, %d bytes)", e.Peer, e.Tag, e.Bytes)
}

func (e *OpError) Error() string {
	return e.Op() + ": " + strings.TrimPrefix(e.Err.Error(), "ucx: ")
}

func (e *OpError) Unwrap() error { return e.Err }

// WaitError is a failed Batch.Wait: every operation that failed or was
// still pending, in batch order (receives, then sends).
type WaitError struct {
	Ops   []*OpError
	Total int // operations in the batch
}

func (e *WaitError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "ucx: wait: %d of %d operations failed: ", len(e.Ops), e.Total)
	for i, op := range e.Ops {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(op.Error())
	}
	return b.String()
}

// Unwrap exposes every operation's error to errors.Is and errors.As.
func (e *WaitError) Unwrap() []error {
	errs := make([]error, len(e.Ops))
	for i, op := range e.Ops {
		errs[i] = op
	}
	return errs
}
