package launch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"
)

// Local runs N copies of a program on this machine, one per rank.
type Local struct {
	N    int
	Path string   // the program, usually os.Executable()
	Args []string // its arguments (without argv[0]), the same for every rank
	// Env returns the whole environment of rank r's process.
	Env            func(rank int) []string
	Stdout, Stderr io.Writer
	Log            zerolog.Logger
	// Grace is how long a rank has to exit after SIGTERM before it is
	// killed; 0 means 2s.
	Grace time.Duration
}

// RankExit is how one rank's process ended.
type RankExit struct {
	Rank   int
	Pid    int
	Code   int    // exit status, -1 if killed by a signal
	Signal string // the signal that ended it, if any
	// Stopped says halod stopped this rank itself, because another rank
	// failed first or the run was interrupted.
	Stopped bool
}

func (e RankExit) String() string {
	switch {
	case e.Signal != "" && e.Stopped:
		return fmt.Sprintf("rank %d (pid %d) was stopped", e.Rank, e.Pid)
	case e.Signal != "":
		return fmt.Sprintf("rank %d (pid %d) died of a signal: %s", e.Rank, e.Pid, e.Signal)
	}
	return fmt.Sprintf("rank %d (pid %d) exited with status %d", e.Rank, e.Pid, e.Code)
}

// Error is the failure of a local run: the rank that failed first (the
// cause) and how every rank ended.
type Error struct {
	First RankExit
	Ranks []RankExit
	// Interrupted is set when the run was cancelled from outside.
	Interrupted bool
}

func (e *Error) Error() string {
	var others []string
	for _, r := range e.Ranks {
		if (e.Interrupted || r.Rank != e.First.Rank) && (r.Code != 0 || r.Signal != "") {
			others = append(others, r.String())
		}
	}
	if e.Interrupted {
		if len(others) == 0 {
			return "interrupted"
		}
		return "interrupted: " + strings.Join(others, ", ")
	}
	msg := e.First.String()
	if len(others) > 0 {
		msg += "; then " + strings.Join(others, ", ")
	}
	return msg
}

// ExitCode is the status a launcher should exit with: the first failed
// rank's status, or 1 if it was killed by a signal.
func (e *Error) ExitCode() int {
	if e.First.Code > 0 {
		return e.First.Code
	}
	return 1
}

// Run starts every rank, waits for all of them, and returns nil if all
// exited with status 0. As soon as one rank fails, or ctx is cancelled,
// the others are sent SIGTERM and, after Grace, SIGKILL, each by its pid;
// no rank outlives Run. Ranks also die with this process (PR_SET_PDEATHSIG).
func (l *Local) Run(ctx context.Context) error {
	if l.N < 1 {
		return fmt.Errorf("launch: %d ranks", l.N)
	}
	grace := l.Grace
	if grace == 0 {
		grace = 2 * time.Second
	}
	type result struct {
		rank int
		err  error
	}
	cmds := make([]*exec.Cmd, l.N)
	done := make(chan result, l.N)
	var mu sync.Mutex
	stopped := make([]bool, l.N)
	exited := make([]bool, l.N)

	stopAll := func(except int) {
		mu.Lock()
		defer mu.Unlock()
		for r, c := range cmds {
			if c == nil || c.Process == nil || exited[r] || r == except || stopped[r] {
				continue
			}
			stopped[r] = true
			l.Log.Debug().Int("rank", r).Int("pid", c.Process.Pid).Msg("stopping rank")
			c.Process.Signal(syscall.SIGTERM)
			p := c.Process
			time.AfterFunc(grace, func() {
				mu.Lock()
				gone := exited[r]
				mu.Unlock()
				if !gone {
					l.Log.Warn().Int("rank", r).Int("pid", p.Pid).Dur("grace", grace).Msg("rank did not stop, killing it")
					p.Kill()
				}
			})
		}
	}

	stdout, stderr := shared(l.Stdout), shared(l.Stderr)
	started := 0
	var startErr error
	for r := 0; r < l.N; r++ {
		c := exec.Command(l.Path, l.Args...)
		c.Env = l.Env(r)
		c.Stdout, c.Stderr = stdout, stderr
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		mu.Lock()
		err := c.Start()
		if err == nil {
			cmds[r] = c
		}
		mu.Unlock()
		if err != nil {
			startErr = fmt.Errorf("launch: starting rank %d: %w", r, err)
			break
		}
		l.Log.Debug().Int("rank", r).Int("pid", c.Process.Pid).Msg("started rank")
		started++
		go func(r int) {
			err := c.Wait()
			mu.Lock()
			exited[r] = true
			mu.Unlock()
			done <- result{r, err}
		}(r)
	}
	if startErr != nil {
		stopAll(-1)
	}

	exits := make([]RankExit, 0, started)
	var first *RankExit
	interrupted := false
	ctxDone := ctx.Done()
	for len(exits) < started {
		select {
		case <-ctxDone:
			ctxDone = nil
			interrupted = true
			l.Log.Warn().Msg("interrupted, stopping every rank")
			stopAll(-1)
			continue
		case res := <-done:
			e := RankExit{Rank: res.rank, Pid: cmds[res.rank].Process.Pid}
			mu.Lock()
			e.Stopped = stopped[res.rank]
			mu.Unlock()
			var xe *exec.ExitError
			switch {
			case res.err == nil:
			case errors.As(res.err, &xe):
				e.Code = xe.ExitCode()
				if ws, ok := xe.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					e.Signal = ws.Signal().String()
				}
			default:
				e.Code = -1
				e.Signal = res.err.Error()
			}
			exits = append(exits, e)
			if (e.Code != 0 || e.Signal != "") && first == nil && !e.Stopped {
				first = &exits[len(exits)-1]
				f := *first
				first = &f
				l.Log.Debug().Int("rank", e.Rank).Int("code", e.Code).Str("signal", e.Signal).Msg("rank failed, stopping the others")
				stopAll(e.Rank)
			}
		}
	}
	sort.Slice(exits, func(i, j int) bool { return exits[i].Rank < exits[j].Rank })
	if startErr != nil {
		return startErr
	}
	if first == nil && !interrupted {
		return nil
	}
	e := &Error{Ranks: exits, Interrupted: interrupted}
	if first != nil {
		e.First = *first
	} else if len(exits) > 0 {
		e.First = exits[0]
	}
	return e
}

// shared makes a writer safe for the copying goroutines of several
// processes; files are passed to the processes as they are.
func shared(w io.Writer) io.Writer {
	if w == nil {
		return nil
	}
	if _, ok := w.(*os.File); ok {
		return w
	}
	return &lockedWriter{w: w}
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
