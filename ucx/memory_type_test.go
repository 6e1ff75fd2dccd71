package ucx

import (
	"errors"
	"strings"
	"testing"

	"github.com/halo-cp/halo/halo/transport"
)

// TestMemoryTypes asks the real UCX which memory it moves. Where it has no
// CUDA support (Debian's build) an operation on CUDA memory is refused when
// it is prepared, with what to do, before any pointer reaches UCX.
func TestMemoryTypes(t *testing.T) {
	a, _ := openPair(t, testOptions())
	names := a.MemoryTypes()
	t.Logf("UCX %s moves %v", Version(), names)
	if !a.Moves(transport.Host) || len(names) == 0 || names[0] != "host" {
		t.Fatalf("Moves(host) = %v, MemoryTypes() = %v", a.Moves(transport.Host), names)
	}
	if a.Moves(transport.Memory(9)) {
		t.Error("Moves(9) = true")
	}
	cuda := strings.Contains(" "+strings.Join(names, " ")+" ", " cuda ")
	if a.Moves(transport.CUDA) != cuda {
		t.Fatalf("Moves(cuda) = %v, but MemoryTypes() = %v", a.Moves(transport.CUDA), names)
	}
	if cuda {
		t.Skip("this UCX moves CUDA memory: nothing to refuse")
	}
	_, err := a.Prepare([]Op{{Peer: 1, Tag: 1, Send: true, Segs: contig(0, 64), Memory: transport.CUDA}})
	if !errors.Is(err, ErrMemoryType) || !strings.Contains(err.Error(), "not cuda") || !strings.Contains(err.Error(), "--with-cuda") {
		t.Fatalf("Prepare of a CUDA send: %v", err)
	}
}
