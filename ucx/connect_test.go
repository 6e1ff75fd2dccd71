package ucx

import (
	"errors"
	"strings"
	"testing"
)

// A rank whose process ended after it gave its address is a failed peer,
// named, not a transport error (issue 24 §4: UCX 1.13 reported a shared
// memory error, printed on stderr, and ErrTransport followed).
func TestConnectToAGoneRank(t *testing.T) {
	for _, peerErr := range []bool{false, true} {
		h := startHelper(t, "victim", "HALO_UCX_RANK=1", "HALO_UCX_SIZE=2", boolEnv("HALO_UCX_PEER_ERR", peerErr))
		h.readAddr(t)
		h.cmd.Process.Kill()
		h.reap()
		tr, err := Open(0, 2, Options{PeerErrorHandling: peerErr})
		if err != nil {
			t.Fatal(err)
		}
		err = tr.Connect([][]byte{tr.Address(), h.addr})
		tr.Close()
		if !errors.Is(err, ErrPeerFailed) || !strings.Contains(err.Error(), "rank 1") {
			t.Errorf("peer error handling %v: got %v, want ErrPeerFailed naming rank 1", peerErr, err)
		}
	}
}
