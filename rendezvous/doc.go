// Package rendezvous lets the ranks of a job find each other before they can
// talk over UCX: every rank contributes an opaque payload (its UCX worker
// address) and receives everyone's, in rank order.
//
// Underneath is a tiny key/value store reached over TCP. Keys live in a
// namespace per (job, attempt); a key is written once, and a read blocks until
// every key it names exists, the wait runs out, or the job fails. Allgather is
// built on top of that: rank r writes its payload under its own key, then reads
// the keys of all ranks.
//
// The same Server runs in two places: embedded in rank 0 of a job, where
// HostAllgather hosts it for that one job and closes it once every rank has its
// result, and as a shared long-running daemon serving many jobs at once.
//
// The wire protocol is described in docs/rendezvous.md; Decode, AppendMessage
// and ReadFrame are its codec.
package rendezvous
