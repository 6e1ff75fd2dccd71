// Package cli is halod's command line: one file per command, flags in one
// slice per command, each flag also read from a HALO_* environment variable.
// Main returns the exit status; only package main exits the process.
package cli

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"

	"github.com/halo-cp/halo/halo"
	"github.com/rs/zerolog"
	ucli "github.com/urfave/cli/v2"
)

// Exit statuses.
const (
	exitOK      = 0
	exitFailure = 1 // the command ran and failed
	exitUsage   = 2 // bad flags, arguments or environment
	exitWrong   = 3 // halod bench: the data received was wrong
)

// usageError is a mistake on the command line (or in the HALO_* variables
// that stand in for flags): exit status 2.
type usageError struct {
	cmd string // "halod bench"
	msg string
}

func (e *usageError) Error() string { return e.msg }

func usagef(c *ucli.Context, format string, args ...any) error {
	return &usageError{cmd: commandPath(c), msg: fmt.Sprintf(format, args...)}
}

// exitError carries an exit status; logged says the message has already
// gone to the log, so Main does not print it again.
type exitError struct {
	code   int
	err    error
	logged bool
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// failed logs err where it was first seen and returns the exit error for it.
func failed(log zerolog.Logger, code int, err error, msg string) error {
	log.Error().Err(err).Msg(msg)
	return &exitError{code: code, err: fmt.Errorf("%s: %w", msg, err), logged: true}
}

func commandPath(c *ucli.Context) string {
	if c == nil || c.Command == nil || c.Command.Name == "" {
		return "halod"
	}
	return "halod " + c.Command.Name
}

// Main runs halod with args (args[0] is the program name) and returns the
// process's exit status.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	app := newApp(stdin, stdout, stderr)
	err := app.Run(args)
	return exitStatus(err, stderr)
}

func exitStatus(err error, stderr io.Writer) int {
	if err == nil {
		return exitOK
	}
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "%s: %s\nRun '%s --help' to see what to type.\n", ue.cmd, ue.msg, ue.cmd)
		return exitUsage
	}
	var ee *exitError
	if errors.As(err, &ee) {
		if !ee.logged {
			fmt.Fprintf(stderr, "halod: %v\n", ee.err)
		}
		return ee.code
	}
	fmt.Fprintf(stderr, "halod: %v\n", err)
	return exitFailure
}

func newApp(stdin io.Reader, stdout, stderr io.Writer) *ucli.App {
	onUsage := func(c *ucli.Context, err error, _ bool) error {
		return &usageError{cmd: commandPath(c), msg: flagMessage(err.Error())}
	}
	app := &ucli.App{
		Name:    "halod",
		Usage:   "halo's daemon and CLI: rendezvous service, benchmark, environment report",
		Version: fmt.Sprintf("%s (%s %s/%s)", halo.Version, runtime.Version(), runtime.GOOS, runtime.GOARCH),
		Description: `halo moves the halos of context-parallel tensors between ranks over UCX.

First steps on a new machine:
   halod info                      what UCX sees here (transports, devices, settings)
   halod bench --local 2 --check   run 2 ranks on this machine and verify the data
   halod bench --local 4 --max-bytes 4M --plot bench.png

On a cluster, run "halod bench" under your launcher (torchrun --no_python,
mpirun, srun); ranks come from RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_*.
"halod serve" is a rendezvous service that many jobs can share
("halod bench --help" shows the command lines).

Every flag can also be set with the HALO_* environment variable shown beside it.
Exit status: 0 success, 1 failure, 2 bad usage, 3 benchmark data was wrong.`,
		Reader:               stdin,
		Writer:               stdout,
		ErrWriter:            stderr,
		Flags:                logFlags(),
		OnUsageError:         onUsage,
		HideHelpCommand:      true,
		Suggest:              true,
		ExitErrHandler:       func(*ucli.Context, error) {}, // Main decides the status
		EnableBashCompletion: false,
		Action: func(c *ucli.Context) error {
			if c.Args().Present() {
				return usagef(c, "unknown command %q (commands: serve, bench, info, version)", c.Args().First())
			}
			return ucli.ShowAppHelp(c)
		},
		Commands: []*ucli.Command{
			serveCommand(),
			benchCommand(),
			benchRankCommand(),
			infoCommand(),
			versionCommand(),
		},
	}
	for _, cmd := range app.Commands {
		cmd.OnUsageError = onUsage
		cmd.Flags = append(cmd.Flags, logFlags()...)
	}
	return app
}

// flagMessage rewords the flag package's errors, which say "-name" for
// flags people type as "--name".
func flagMessage(msg string) string {
	switch {
	case strings.HasPrefix(msg, "flag provided but not defined: -"):
		return "unknown flag --" + strings.TrimPrefix(msg, "flag provided but not defined: -")
	case strings.HasPrefix(msg, "flag needs an argument: -"):
		return "--" + strings.TrimLeft(strings.TrimPrefix(msg, "flag needs an argument: "), "-") + " needs a value"
	}
	msg = strings.Replace(msg, " for flag -", " for --", 1)
	msg = strings.Replace(msg, " for flag ", " for --", 1)
	msg = strings.Replace(msg, ": parse error", ": not a number", 1)
	return msg
}

// logFlags are accepted before and after the command name, so that both
// "halod --log-level debug bench" and "halod bench --log-level debug" work.
func logFlags() []ucli.Flag {
	return []ucli.Flag{
		&ucli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"HALO_LOG_LEVEL"},
			Usage: "least severe log lines to print: trace, debug, info, warn or error"},
		&ucli.StringFlag{Name: "log-format", Value: logAuto, EnvVars: []string{"HALO_LOG_FORMAT"},
			Usage: "auto (readable on a terminal, JSON lines otherwise), json or console"},
	}
}

// flagString returns a flag's value from the innermost command where it was
// given on the command line, else from the command itself (environment or
// default).
func flagString(c *ucli.Context, name string) string {
	for _, x := range c.Lineage() {
		for _, n := range x.LocalFlagNames() {
			if n == name {
				return x.String(name)
			}
		}
	}
	return c.String(name)
}

// logger builds the logger for a command from the logging flags.
func logger(c *ucli.Context) (zerolog.Logger, error) {
	log, err := newLogger(c.App.ErrWriter, flagString(c, "log-level"), flagString(c, "log-format"))
	if err != nil {
		return log, usagef(c, "%v", err)
	}
	return log, nil
}
