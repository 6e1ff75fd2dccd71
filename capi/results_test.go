package main

import (
	"errors"
	"fmt"
	"testing"

	"github.com/halo-cp/halo/halo"
)

// Every halo error class has its own result code (values from
// include/halo.h), however deeply it is wrapped; an error of no class is a
// bug and says so.
func TestEveryClassHasItsCode(t *testing.T) {
	want := map[error]int{
		halo.ErrInvalid: 1, halo.ErrMismatch: 3, halo.ErrTimeout: 4, halo.ErrPeerFailed: 5,
		halo.ErrFailed: 6, halo.ErrRendezvous: 7, halo.ErrTransport: 8, halo.ErrState: 9,
		halo.ErrClosed: 9, halo.ErrInternal: 10,
	}
	if len(want) != len(halo.Classes) {
		t.Fatalf("%d classes in halo, %d in this test: map the new one to its code", len(halo.Classes), len(want))
	}
	for _, class := range halo.Classes {
		for _, err := range []error{
			class,
			fmt.Errorf("rank 3: forward of plan 2: %w", class),
			halo.Classify(class, errors.New("from below")),
		} {
			if got := int(code(err)); got != want[class] {
				t.Errorf("code(%v) = %d, want %d", err, got, want[class])
			}
		}
	}
	if got := int(code(fmt.Errorf("%w: NULL", errHandle))); got != 2 {
		t.Errorf("invalid handle: code %d, want 2", got)
	}
	if got := int(code(errors.New("unclassed"))); got != 10 {
		t.Errorf("an unclassed error: code %d, want HALO_ERR_INTERNAL (10)", got)
	}
	if code(nil) != 0 {
		t.Error("nil is not HALO_SUCCESS")
	}
}
