package rendezvous

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// peerUID finds the user of the process at the other end of a loopback TCP
// connection: the kernel lists every socket with its owner in
// /proc/net/tcp (tcp6 for IPv6), and the client's socket is the one whose
// local address is our remote one and whose remote address is our local one.
func peerUID(c net.Conn) (int, error) {
	local, ok1 := c.LocalAddr().(*net.TCPAddr)
	remote, ok2 := c.RemoteAddr().(*net.TCPAddr)
	if !ok1 || !ok2 {
		return 0, errUIDUnsupported
	}
	file := "/proc/net/tcp"
	if remote.IP.To4() == nil {
		file = "/proc/net/tcp6"
	}
	f, err := os.Open(file)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // the header
	for sc.Scan() {
		// sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || !procAddrIs(fields[1], remote) || !procAddrIs(fields[2], local) {
			continue
		}
		return strconv.Atoi(fields[7])
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no socket %s -> %s in %s", remote, local, file)
}

// procAddrIs compares an address of /proc/net/tcp{,6} ("0100007F:1F90":
// the IP as 32-bit words in host order, then the port) with a.
func procAddrIs(s string, a *net.TCPAddr) bool {
	ipHex, portHex, ok := strings.Cut(s, ":")
	if !ok {
		return false
	}
	port, err := strconv.ParseUint(portHex, 16, 16)
	if err != nil || int(port) != a.Port {
		return false
	}
	raw, err := hex.DecodeString(ipHex)
	if err != nil || len(raw)%4 != 0 {
		return false
	}
	// Each 32-bit word was printed as a number: on a little-endian host
	// its bytes come out reversed.
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		for i := 0; i < len(raw); i += 4 {
			raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
		}
	}
	want := a.IP.To4()
	if len(raw) == 16 {
		want = a.IP.To16()
	}
	return want != nil && net.IP(raw).Equal(want)
}
