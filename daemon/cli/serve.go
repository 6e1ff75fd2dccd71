package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/rendezvous"
	ucli "github.com/urfave/cli/v2"
)

// tokenFileEnv names the file holding the token; the token itself is
// comm.SettingToken's variable.
const tokenFileEnv = "HALO_TOKEN_FILE"

func serveFlags() []ucli.Flag {
	return []ucli.Flag{
		&ucli.StringFlag{Name: "listen", Value: rendezvous.DefaultAddr, EnvVars: []string{"HALO_LISTEN"},
			Usage: "host:port to listen on; loopback unless you give another address (e.g. 0.0.0.0:29700 for every interface)"},
		&ucli.StringFlag{Name: "token", EnvVars: []string{comm.SettingToken.Env},
			Usage: "shared secret every client must present (prefer --token-file or the variable: command lines are visible to other users)"},
		&ucli.StringFlag{Name: "token-file", EnvVars: []string{tokenFileEnv},
			Usage: "read the token from this file (its first line)"},
		boolFlag{&ucli.BoolFlag{Name: "insecure", EnvVars: []string{"HALO_INSECURE"},
			Usage: "serve without a token; allowed on loopback addresses only"}},
		&ucli.GenericFlag{Name: "max-message-bytes", Value: ptr(byteSize(rendezvous.DefaultMaxMessageBytes)), EnvVars: []string{"HALO_MAX_MESSAGE_BYTES"},
			Usage: "largest request a client may send (a put's key and value)"},
		&ucli.IntFlag{Name: "max-keys-per-job", Value: rendezvous.DefaultMaxKeysPerJob, EnvVars: []string{"HALO_MAX_KEYS_PER_JOB"},
			Usage: "keys stored per job and attempt, and so the largest world size"},
		&ucli.GenericFlag{Name: "max-job-bytes", Value: ptr(byteSize(rendezvous.DefaultMaxJobBytes)), EnvVars: []string{"HALO_MAX_JOB_BYTES"},
			Usage: "bytes (keys and values) stored per job and attempt"},
		&ucli.IntFlag{Name: "max-jobs", Value: rendezvous.DefaultMaxJobs, EnvVars: []string{"HALO_MAX_JOBS"},
			Usage: "jobs (job id and attempt) held at once"},
		&ucli.IntFlag{Name: "max-conns", Value: rendezvous.DefaultMaxConns, EnvVars: []string{"HALO_MAX_CONNS"},
			Usage: "open connections; every waiting rank holds one, so at least the largest job's world size"},
		&ucli.GenericFlag{Name: "idle-timeout", Value: ptr(millis(rendezvous.DefaultIdleTimeout)), EnvVars: []string{"HALO_IDLE_TIMEOUT"},
			Usage: "a client that takes longer than this to send a request is dropped"},
		&ucli.GenericFlag{Name: "max-wait", Value: ptr(millis(rendezvous.DefaultMaxWait)), EnvVars: []string{"HALO_MAX_WAIT"},
			Usage: "longest a rank may wait for the others, whatever it asks"},
		&ucli.GenericFlag{Name: "job-ttl", Value: ptr(millis(rendezvous.DefaultJobTTL)), EnvVars: []string{"HALO_JOB_TTL"},
			Usage: "how long a job nobody is connected to is kept"},
		&ucli.GenericFlag{Name: "shutdown-timeout", Value: ptr(millis(10 * time.Second)), EnvVars: []string{"HALO_SHUTDOWN_TIMEOUT"},
			Usage: "on SIGTERM or SIGINT, how long connections get to finish before they are closed"},
	}
}

func ptr[T any](v T) *T { return &v }

func serveCommand() *ucli.Command {
	return &ucli.Command{
		Name:  "serve",
		Usage: "run the rendezvous service that the ranks of many jobs find each other through",
		UsageText: fmt.Sprintf(`halod serve --token-file /etc/halo/token --listen 0.0.0.0:29700
%[1]s=secret halod serve                 (loopback, port 29700)
halod serve --insecure                        (no token, loopback only: for one machine)

Ranks use it with %[2]s=host:29700 %[3]s=1 and the
same %[1]s. Jobs are kept apart by %[4]s; a restarted job must use
a new %[5]s. SIGTERM or SIGINT shuts the service down gracefully.
The protocol is described in docs/rendezvous.md.`, comm.SettingToken.Env, comm.SettingRendezvous.Env,
			comm.SettingRendezvousExternal.Env, comm.SettingJobID.Env, comm.SettingJobAttempt.Env),
		Flags:  serveFlags(),
		Action: serve,
	}
}

func readToken(c *ucli.Context) (string, error) {
	token, file := c.String("token"), c.String("token-file")
	if file == "" {
		return token, nil
	}
	if token != "" {
		return "", usagef(c, "give the token once: --token (%s) or --token-file (%s), not both", comm.SettingToken.Env, tokenFileEnv)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", usagef(c, "--token-file: %v", err)
	}
	token = strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0])
	if token == "" {
		return "", usagef(c, "--token-file %s: the first line is empty", file)
	}
	return token, nil
}

// loopbackHost says whether host (from host:port) is a loopback address;
// names other than localhost are not resolved here.
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func serve(c *ucli.Context) error {
	log, err := logger(c)
	if err != nil {
		return err
	}
	if c.Args().Present() {
		return usagef(c, "takes no arguments (got %q)", c.Args().First())
	}
	token, err := readToken(c)
	if err != nil {
		return err
	}
	addr := c.String("listen")
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return usagef(c, "--listen %q: %v (want host:port, e.g. 127.0.0.1:29700)", addr, err)
	}
	switch {
	case token == "" && !c.Bool("insecure"):
		return usagef(c, "refusing to start without a token: set --token-file, --token or %s (every rank needs the same), or pass --insecure to serve this machine's loopback only", comm.SettingToken.Env)
	case token == "" && !loopbackHost(host):
		return usagef(c, "--insecure is allowed on loopback addresses only, not on %q: set a token to listen there", addr)
	case token != "" && c.Bool("insecure"):
		log.Warn().Msg("--insecure has no effect: a token is set, and clients must present it")
	}
	cfg := rendezvous.ServerConfig{
		Token:           token,
		Insecure:        token == "",
		MaxMessageBytes: int(*c.Generic("max-message-bytes").(*byteSize)),
		MaxKeysPerJob:   c.Int("max-keys-per-job"),
		MaxJobBytes:     int(*c.Generic("max-job-bytes").(*byteSize)),
		MaxJobs:         c.Int("max-jobs"),
		MaxConns:        c.Int("max-conns"),
		IdleTimeout:     duration(c, "idle-timeout"),
		MaxWait:         duration(c, "max-wait"),
		JobTTL:          duration(c, "job-ttl"),
		Logger:          log,
	}
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"max-message-bytes", int64(cfg.MaxMessageBytes)}, {"max-keys-per-job", int64(cfg.MaxKeysPerJob)},
		{"max-job-bytes", int64(cfg.MaxJobBytes)}, {"max-jobs", int64(cfg.MaxJobs)}, {"max-conns", int64(cfg.MaxConns)},
	} {
		if f.v <= 0 {
			return usagef(c, "--%s must be positive", f.name)
		}
	}
	grace := duration(c, "shutdown-timeout") // the durations are positive: see millis
	srv, err := rendezvous.NewServer(cfg)
	if err != nil {
		return usagef(c, "%v", err)
	}

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	served := make(chan error, 1)
	go func() { served <- srv.ListenAndServe(addr) }()

	select {
	case err := <-served:
		// It never started: the address is taken, or not ours.
		return failed(log, exitFailure, err, "rendezvous service failed")
	case sig := <-sigs:
		log.Info().Str("signal", sig.String()).Dur("grace", grace).Msg("shutting down")
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	go func() {
		// A second signal cuts the grace period short.
		select {
		case sig := <-sigs:
			log.Warn().Str("signal", sig.String()).Msg("second signal: closing every connection now")
			cancel()
		case <-ctx.Done():
		}
	}()
	shutErr := srv.Shutdown(ctx)
	if err := <-served; err != nil && !errors.Is(err, rendezvous.ErrServerClosed) {
		return failed(log, exitFailure, err, "rendezvous service failed")
	}
	if shutErr != nil {
		log.Warn().Err(shutErr).Msg("some connections were closed before they finished")
	}
	log.Info().Msg("stopped")
	return nil
}
