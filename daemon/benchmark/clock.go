package benchmark

import _ "unsafe" // go:linkname

// nanotime is the runtime's monotonic clock, which times the calls: one
// clock reading where time.Now takes two (wall and monotonic), each 43 ns on
// a VM's kvm-clock, against a 2 KiB exchange's 1-2 µs. (MPI_Wtime, which
// bench/mpi_halo.c times with, is one reading too.)
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64
