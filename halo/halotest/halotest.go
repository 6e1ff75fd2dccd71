// Package halotest helps tests run several ranks in one process: an
// in-memory transport with real tag semantics (MemHub) and runners that start
// one goroutine per rank. It is imported by tests only, so none of it is
// linked into libhalo.so or halod.
package halotest

import (
	"sync"

	"github.com/halo-cp/halo/halo"
)

// Ranks runs fn for ranks 0 .. w-1 at once, one goroutine each, and returns
// each rank's error once all have returned.
func Ranks(w int, fn func(rank int) error) []error {
	errs := make([]error, w)
	var wg sync.WaitGroup
	for r := 0; r < w; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			errs[r] = fn(r)
		}(r)
	}
	wg.Wait()
	return errs
}

// Groups runs fn on every rank of a fresh in-memory group of w ranks, at
// once, and returns each rank's error.
func Groups(w int, opts halo.GroupOptions, fn func(g *halo.Group) error) []error {
	hub := NewMemHub(w)
	return Ranks(w, func(r int) error {
		g, err := halo.NewGroup(hub.Transport(r), opts)
		if err != nil {
			return err
		}
		return fn(g)
	})
}

// Group is one rank's Group on an in-memory hub of its own, for tests that
// need no peer.
func Group(opts halo.GroupOptions) *halo.Group {
	g, err := halo.NewGroup(NewMemHub(1).Transport(0), opts)
	if err != nil {
		panic(err) // only for invalid options, a bug in the test
	}
	return g
}
