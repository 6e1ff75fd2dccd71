package main

import "testing"

func TestABIConstants(t *testing.T) {
	for _, m := range abiMismatches() {
		t.Error(m)
	}
}
