// Package ucx is halo's binding to UCX's libucp: tagged, batched
// point-to-point messages between the ranks of one group, one UCP context and
// one worker per Transport.
//
// The model is "prepare once, post every step": Prepare describes a fixed
// list of operations as offsets into numbered base buffers, Post starts them
// all for one set of base addresses, Wait progresses until they are done.
// Post and Wait are one call into C each and allocate nothing in Go.
//
// # Threads
//
// A Transport and its batches may be used by one goroutine at a time (calls
// are serialised by a mutex, so a concurrent Close waits for a running Wait);
// the worker runs in UCS_THREAD_MODE_SERIALIZED.
//
// # Memory
//
// Buffers from Transport.Alloc are C memory. Base addresses given to Post may
// also point to other C memory or to pinned Go memory (runtime.Pinner); they
// must stay valid until Wait returns. When a Wait fails, UCX lets go of the
// batch's memory before Wait returns: pending receives are cancelled and the
// endpoints of peers with sends still pending are force-closed.
//
// # Tags
//
// UCX matches receives on the tag alone, not on the sender. So that a
// receive from rank 1 matches only rank 1's messages, the sender's rank is
// put in the top bits of the tag on the wire; Transport.TagBits says how many
// low bits remain for the caller's tags.
//
// # Signals
//
// libucs installs handlers for SIGILL, SIGSEGV, SIGBUS and SIGFPE
// (UCX_ERROR_SIGNALS) in its library constructor, before the Go runtime
// starts. In a Go program the runtime then installs its own over them and
// forwards faults in C code to UCX's, so Go's nil-pointer panics keep working.
// Where UCX's handlers win anyway (UCX's sigaction interposer libucs_signal.so
// preloaded), Open hands SIGSEGV, SIGBUS and SIGFPE back to the Go runtime.
// Setting UCX_ERROR_SIGNALS from Go has no effect: the constructor has
// already read it. See NOTES.md.
package ucx
