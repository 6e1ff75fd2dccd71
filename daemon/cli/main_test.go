package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// halodPath is the halod binary the tests run, built once by TestMain.
var halodPath string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "halod-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	halodPath = filepath.Join(dir, "halod")
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	build := exec.Command(goTool, "build", "-o", halodPath, "github.com/halo-cp/halo/daemon/cmd/halod")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building halod:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// result is how a halod run ended.
type result struct {
	stdout, stderr string
	code           int
	took           time.Duration
}

// cleanEnv is the test process's environment without HALO_* and launcher
// variables, so that a developer's shell cannot change what a test sees.
func cleanEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "HALO_"), k == "RANK", k == "WORLD_SIZE", k == "LOCAL_RANK", k == "LOCAL_WORLD_SIZE",
			k == "MASTER_ADDR", k == "MASTER_PORT", strings.HasPrefix(k, "TORCHELASTIC_"), strings.HasPrefix(k, "OMPI_"),
			strings.HasPrefix(k, "SLURM_"), strings.HasPrefix(k, "PMI_"):
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// halod runs the binary to completion (at most a minute).
func halod(t *testing.T, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, halodPath, args...)
	cmd.Env = cleanEnv(env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	start := time.Now()
	err := cmd.Run()
	r := result{stdout: out.String(), stderr: errb.String(), took: time.Since(start)}
	var xe *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &xe):
		r.code = xe.ExitCode()
	default:
		t.Fatalf("halod %s: %v", strings.Join(args, " "), err)
	}
	if ctx.Err() != nil {
		t.Fatalf("halod %s did not finish within a minute\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.stdout, r.stderr)
	}
	return r
}

// syncBuffer collects a running process's output.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// logLine finds the first JSON log line whose message is msg.
func (s *syncBuffer) logLine(msg string) map[string]any {
	sc := bufio.NewScanner(strings.NewReader(s.String()))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["message"] == msg {
			return m
		}
	}
	return nil
}

// waitLog waits up to 10s for a log line with message msg.
func (s *syncBuffer) waitLog(t *testing.T, msg string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if m := s.logLine(msg); m != nil {
			return m
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no log line %q in:\n%s", msg, s.String())
	return nil
}

// background is a halod process the test stops by its pid.
type background struct {
	cmd    *exec.Cmd
	stdout *syncBuffer
	stderr *syncBuffer
	done   chan struct{}
	err    error
}

func startHalod(t *testing.T, env []string, args ...string) *background {
	t.Helper()
	b := &background{stdout: &syncBuffer{}, stderr: &syncBuffer{}, done: make(chan struct{})}
	b.cmd = exec.Command(halodPath, args...)
	b.cmd.Env = cleanEnv(env...)
	b.cmd.Stdout, b.cmd.Stderr = b.stdout, b.stderr
	if err := b.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { b.err = b.cmd.Wait(); close(b.done) }()
	t.Cleanup(func() {
		b.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-b.done:
		case <-time.After(5 * time.Second):
			b.cmd.Process.Kill()
			<-b.done
		}
	})
	return b
}

// wait waits up to d for the process to exit and returns its status.
func (b *background) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-b.done:
	case <-time.After(d):
		t.Fatalf("halod still running after %v\nstderr:\n%s", d, b.stderr.String())
	}
	var xe *exec.ExitError
	if errors.As(b.err, &xe) {
		return xe.ExitCode()
	}
	if b.err != nil {
		t.Fatal(b.err)
	}
	return 0
}
