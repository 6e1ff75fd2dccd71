package cli

import (
	"fmt"
	"runtime"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/ucx"
	ucli "github.com/urfave/cli/v2"
)

func versionCommand() *ucli.Command {
	return &ucli.Command{
		Name:  "version",
		Usage: "print the versions of halo, UCX and Go",
		Action: func(c *ucli.Context) error {
			if c.Args().Present() {
				return usagef(c, "takes no arguments (got %q)", c.Args().First())
			}
			fmt.Fprintf(c.App.Writer, "halod %s\nUCX %s\n%s %s/%s\n", halo.Version, ucx.Version(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
			return nil
		},
	}
}
