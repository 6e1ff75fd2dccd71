package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/daemon/launch"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/ucx"
	ucli "github.com/urfave/cli/v2"
)

func infoCommand() *ucli.Command {
	return &ucli.Command{
		Name:  "info",
		Usage: "show halo's and UCX's versions, the transports and devices UCX sees, and the settings that change its choice",
		Flags: []ucli.Flag{
			boolFlag{&ucli.BoolFlag{Name: "json", EnvVars: []string{"HALO_INFO_JSON"}, Usage: "print JSON instead of text"}},
		},
		Action: info,
	}
}

// setting is an environment variable that changes what UCX or halo does.
type setting struct {
	Name    string `json:"name"`
	Value   string `json:"value,omitempty"`
	Set     bool   `json:"set"`
	Default string `json:"default,omitempty"`
	Means   string `json:"means,omitempty"`
	// Invalid says why the library would refuse Value.
	Invalid string             `json:"invalid,omitempty"`
	check   func(string) error // nil: any value goes
}

var ucxSettings = []setting{
	{Name: "UCX_TLS", Means: "transports UCX may use (e.g. shm,self on one machine; rc,sm,self on InfiniBand; tcp)"},
	{Name: "UCX_NET_DEVICES", Means: "network devices UCX may use (e.g. mlx5_0:1, eth0)"},
	{Name: "UCX_RNDV_THRESH", Means: "message size from which UCX switches to the rendezvous protocol"},
	{Name: "UCX_RNDV_SCHEME", Means: "how rendezvous moves data (get_zcopy, put_zcopy, ...)"},
	{Name: "UCX_ZCOPY_THRESH", Means: "message size from which UCX sends without copying"},
	{Name: "UCX_MAX_RNDV_LANES", Means: "lanes a large message is striped over"},
	{Name: "UCX_POSIX_ERROR_HANDLING", Means: "keep posix shared memory on endpoints with peer error handling"},
	{Name: "UCX_SYSV_ERROR_HANDLING", Means: "keep sysv shared memory on endpoints with peer error handling"},
	{Name: "UCX_KEEPALIVE_INTERVAL", Means: "how often UCX checks that peers are alive"},
	{Name: "UCX_ERROR_SIGNALS", Means: "signals UCX catches to print a backtrace"},
	{Name: "UCX_LOG_LEVEL", Means: "UCX's own logging"},
}

// haloSettings is the library's table (comm.Settings).
func haloSettings() []setting {
	out := make([]setting, len(comm.Settings))
	for i, s := range comm.Settings {
		out[i] = setting{Name: s.Env, Default: s.Default, Means: s.Means, check: s.Check}
	}
	return out
}

// lookupSettings fills in the values, then appends every other variable
// with the prefix that is set. Secrets are not shown.
func lookupSettings(known []setting, prefix string) []setting {
	out := make([]setting, 0, len(known))
	seen := map[string]bool{}
	for _, s := range known {
		s.Value, s.Set = os.LookupEnv(s.Name)
		if s.Set && s.Value != "" && s.check != nil {
			if err := s.check(s.Value); err != nil {
				s.Invalid = err.Error()
			}
		}
		seen[s.Name] = true
		out = append(out, s)
	}
	var extra []setting
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, prefix) && !seen[k] {
			extra = append(extra, setting{Name: k, Value: v, Set: true})
		}
	}
	sort.Slice(extra, func(i, j int) bool { return extra[i].Name < extra[j].Name })
	out = append(out, extra...)
	for i := range out {
		if out[i].Set && (strings.Contains(out[i].Name, "TOKEN") || strings.Contains(out[i].Name, "SECRET")) {
			out[i].Value = fmt.Sprintf("(set, %d characters, not shown)", len(out[i].Value))
		}
	}
	return out
}

// selection is what UCX chooses between two workers of this process: the
// transports a pair of ranks on this host would use, and the memory types
// they move.
func selection() (lanes, memory []string, err error) {
	a, err := ucx.Open(0, 2, ucx.Options{})
	if err != nil {
		return nil, nil, err
	}
	defer a.Close()
	memory = a.MemoryTypes()
	b, err := ucx.Open(1, 2, ucx.Options{})
	if err != nil {
		return nil, memory, err
	}
	defer b.Close()
	addrs := [][]byte{a.Address(), b.Address()}
	if err := a.Connect(addrs); err != nil {
		return nil, memory, err
	}
	s, err := a.EndpointInfo(1)
	if err != nil {
		return nil, memory, err
	}
	for _, line := range strings.Split(s, "\n") {
		line = strings.TrimSpace(strings.TrimPrefix(line, "#"))
		if strings.HasPrefix(line, "lane[") || strings.HasPrefix(line, "tag_send:") {
			lanes = append(lanes, strings.Join(strings.Fields(line), " "))
		}
	}
	return lanes, memory, nil
}

// cudaPath says how CUDA tensors travel with this UCX.
func cudaPath(memory []string) string {
	if slices.Contains(memory, "cuda") {
		return "direct: device pointers go to UCX (GPUDirect, cuda_ipc)"
	}
	return "staged: boundary slabs through pinned host buffers (this UCX moves no CUDA memory)"
}

type infoReport struct {
	Halo       string            `json:"halo_version"`
	UCX        string            `json:"ucx_version"`
	UCXPath    string            `json:"ucx_library"` // the libucp file loaded
	Go         string            `json:"go_version"`
	Hostname   string            `json:"hostname"`
	CPUs       int               `json:"cpus"`
	Resources  []ucx.Resource    `json:"ucx_resources"`
	ResErr     string            `json:"ucx_resources_error,omitempty"`
	Selected   []string          `json:"ucx_selected_on_host,omitempty"`
	SelErr     string            `json:"ucx_selected_error,omitempty"`
	Memory     []string          `json:"ucx_memory_types"`
	CUDAPath   string            `json:"cuda_path"`
	UCXEnv     []setting         `json:"ucx_settings"`
	HaloEnv    []setting         `json:"halo_settings"`
	Launcher   *launch.Placement `json:"launcher,omitempty"`
	LaunchErr  string            `json:"launcher_error,omitempty"`
	LaunchVars map[string]string `json:"launcher_variables,omitempty"`
}

func info(c *ucli.Context) error {
	if _, err := logger(c); err != nil {
		return err
	}
	if c.Args().Present() {
		return usagef(c, "takes no arguments (got %q)", c.Args().First())
	}
	host, _ := os.Hostname()
	r := infoReport{Halo: halo.Version, UCX: ucx.Version(), UCXPath: ucx.LibraryPath(), Go: runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH,
		Hostname: host, CPUs: runtime.NumCPU()}
	var err error
	if r.Resources, err = ucx.Resources(); err != nil {
		r.ResErr = err.Error()
	}
	if r.Selected, r.Memory, err = selection(); err != nil {
		r.SelErr = err.Error()
	}
	r.CUDAPath = cudaPath(r.Memory)
	r.UCXEnv = lookupSettings(ucxSettings, "UCX_")
	r.HaloEnv = lookupSettings(haloSettings(), "HALO_")
	if p, ok, err := launch.Detect(os.Getenv); err != nil {
		r.LaunchErr = err.Error()
	} else if ok {
		r.Launcher = &p
	}
	r.LaunchVars = map[string]string{}
	for _, v := range launch.Variables() {
		if val, ok := os.LookupEnv(v); ok {
			r.LaunchVars[v] = val
		}
	}
	if c.Bool("json") {
		enc := json.NewEncoder(c.App.Writer)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	printInfo(c.App.Writer, &r)
	return nil
}

func printInfo(w io.Writer, r *infoReport) {
	fmt.Fprintf(w, "halo     %s\nUCX      %s from %s\nGo       %s\nhost     %s (%d CPUs)\n\n", r.Halo, r.UCX, r.UCXPath, r.Go, r.Hostname, r.CPUs)

	fmt.Fprintln(w, "UCX transports and devices on this host:")
	if r.ResErr != "" {
		fmt.Fprintf(w, "  cannot list them: %s\n", r.ResErr)
	} else {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  TRANSPORT\tDEVICE\tTYPE\tMEMORY DOMAIN")
		for _, res := range r.Resources {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", res.Transport, res.Device, res.Type, res.MemoryDomain)
		}
		tw.Flush()
	}
	fmt.Fprintln(w, "\nWhat UCX picks for two ranks on this host, with the settings below:")
	if r.SelErr != "" {
		fmt.Fprintf(w, "  cannot tell: %s\n", r.SelErr)
	}
	for _, l := range r.Selected {
		fmt.Fprintf(w, "  %s\n", l)
	}
	fmt.Fprintln(w, "  (ranks on other hosts use the network transports above; \"ucx_info -e -u t\" says more)")
	fmt.Fprintf(w, "\nMemory UCX moves: %s\nCUDA tensors:     %s\n", strings.Join(r.Memory, ", "), r.CUDAPath)

	printSettings := func(title string, ss []setting) {
		fmt.Fprintf(w, "\n%s\n", title)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, s := range ss {
			v, means := s.Value, s.Means
			if !s.Set {
				v = "(unset)"
			}
			if s.Invalid != "" {
				v += " (refused: " + s.Invalid + ")"
			}
			if s.Default != "" {
				means += " (default " + s.Default + ")"
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\n", s.Name, v, means)
		}
		tw.Flush()
	}
	printSettings("UCX settings (environment):", r.UCXEnv)
	printSettings("halo settings (environment):", r.HaloEnv)

	fmt.Fprintln(w)
	switch {
	case r.LaunchErr != "":
		fmt.Fprintf(w, "Launcher: %s\n", r.LaunchErr)
	case r.Launcher != nil:
		fmt.Fprintf(w, "Launcher: %s (halod bench runs as this rank)\n", r.Launcher.Describe())
	default:
		fmt.Fprintln(w, "Launcher: none detected; \"halod bench --local N\" starts N ranks here, or run halod bench under torchrun --no_python, mpirun or srun")
	}
}
