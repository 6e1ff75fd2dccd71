package launch

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// AllowedCPUs lists the CPUs this process may run on (its affinity mask,
// which a cgroup or taskset may have narrowed), in increasing order.
func AllowedCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("reading the CPU affinity: %w", err)
	}
	var cpus []int
	for c := 0; c < len(set)*64; c++ {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	if len(cpus) == 0 {
		return nil, fmt.Errorf("no CPU in this process's affinity mask")
	}
	return cpus, nil
}

// Spread assigns n ranks to cpus round robin: rank r gets cpus[r % len].
// Neighbouring ranks, which exchange halos, land on different CPUs
// whenever there are two or more.
func Spread(n int, cpus []int) []int {
	out := make([]int, n)
	for r := range out {
		out[r] = cpus[r%len(cpus)]
	}
	return out
}

// BindProcess pins every thread of this process to cpu; threads created
// later inherit the mask from their creator. It is meant to run early, as a
// launcher's binding would (mpirun --bind-to core, srun --cpu-bind).
func BindProcess(cpu int) error {
	var set unix.CPUSet
	set.Set(cpu)
	bound := map[int]bool{}
	// A thread may start while the list is read; go over it until a pass
	// finds nothing new.
	for pass := 0; pass < 10; pass++ {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("binding to CPU %d: %w", cpu, err)
		}
		fresh := 0
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil || bound[tid] {
				continue
			}
			if err := unix.SchedSetaffinity(tid, &set); err != nil && err != unix.ESRCH {
				return fmt.Errorf("binding thread %d to CPU %d: %w", tid, cpu, err)
			}
			bound[tid] = true
			fresh++
		}
		if fresh == 0 {
			return nil
		}
	}
	return nil
}
