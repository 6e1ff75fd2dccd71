package cli

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/rs/zerolog"
)

// Log formats accepted by --log-format.
const (
	logAuto    = "auto"
	logJSON    = "json"
	logConsole = "console"
)

// isTerminal reports whether w is a terminal (a *os.File on a TTY).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd()))
}

// newLogger builds the process's logger: JSON lines by default, readable
// console output when format is "auto" and w is a terminal.
func newLogger(w io.Writer, level, format string) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(strings.ToLower(strings.TrimSpace(level)))
	if err != nil || level == "" {
		return zerolog.Nop(), fmt.Errorf("--log-level %q: want trace, debug, info, warn or error", level)
	}
	switch strings.ToLower(format) {
	case logAuto, "":
		if isTerminal(w) {
			w = zerolog.ConsoleWriter{Out: w, TimeFormat: "15:04:05.000"}
		}
	case logConsole:
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: "15:04:05.000", NoColor: !isTerminal(w)}
	case logJSON:
	default:
		return zerolog.Nop(), fmt.Errorf("--log-format %q: want auto, json or console", format)
	}
	zerolog.TimeFieldFormat = time.RFC3339Nano
	return zerolog.New(w).Level(lvl).With().Timestamp().Logger(), nil
}
