//go:build !linux

package rendezvous

import "net"

// peerUID is known on Linux only; elsewhere a server without a token takes
// any local client.
func peerUID(net.Conn) (int, error) { return 0, errUIDUnsupported }
