// Command halod is halo's daemon and CLI: the shared rendezvous service
// (halod serve), an nccl-tests-style benchmark (halod bench) and a report of
// what UCX sees on this machine (halod info). Run "halod --help".
package main

import (
	"os"

	"github.com/halo-cp/halo/daemon/cli"
)

func main() {
	os.Exit(cli.Main(os.Args, os.Stdin, os.Stdout, os.Stderr))
}
