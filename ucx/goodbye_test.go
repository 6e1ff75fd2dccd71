package ucx

import (
	"testing"

	"github.com/halo-cp/halo/halo/transport"
)

// What a successful exchange pays for hearing goodbyes (AbortedPeer).
func BenchmarkAbortedPeer(b *testing.B) {
	tr, err := Open(0, 1, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer tr.Close()
	batch, err := tr.Prepare([]transport.Op{})
	if err != nil {
		b.Fatal(err)
	}
	defer batch.Close()
	for b.Loop() {
		batch.AbortedPeer()
	}
}
