package halo

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"testing"
)

// headerDefines returns the HALO_VERSION_* macros of include/halo.h, the
// source of the version that Version copies.
func headerDefines(t *testing.T) map[string]string {
	t.Helper()
	src, err := os.ReadFile("../include/halo.h")
	if err != nil {
		t.Fatal(err)
	}
	defs := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^#define (HALO_VERSION_[A-Z]+) +(.+?)\s*$`).FindAllStringSubmatch(string(src), -1) {
		defs[m[1]] = m[2]
	}
	for _, name := range []string{"MAJOR", "MINOR", "PATCH", "NUMBER", "STRING"} {
		if _, ok := defs["HALO_VERSION_"+name]; !ok {
			t.Fatalf("include/halo.h: no #define HALO_VERSION_%s", name)
		}
	}
	return defs
}

func TestVersionMatchesHeader(t *testing.T) {
	defs := headerDefines(t)
	var part [3]int
	for i, name := range []string{"MAJOR", "MINOR", "PATCH"} {
		n, err := strconv.Atoi(defs["HALO_VERSION_"+name])
		if err != nil || n < 0 {
			t.Fatalf("include/halo.h: HALO_VERSION_%s is %q, not a number", name, defs["HALO_VERSION_"+name])
		}
		part[i] = n
	}
	want := fmt.Sprintf("%d.%d.%d", part[0], part[1], part[2])
	if Version != want {
		t.Errorf("halo.Version is %q, include/halo.h's HALO_VERSION_MAJOR/MINOR/PATCH say %q", Version, want)
	}
	if s := defs["HALO_VERSION_STRING"]; s != strconv.Quote(want) {
		t.Errorf("include/halo.h: HALO_VERSION_STRING is %s, its MAJOR/MINOR/PATCH say %q", s, want)
	}

	// Readers of halo_version_number() (halocp among them) split it as
	// major*10000 + minor*100 + patch; the header must build it that way and
	// minor and patch must fit in two digits.
	const formula = "(HALO_VERSION_MAJOR * 10000 + HALO_VERSION_MINOR * 100 + HALO_VERSION_PATCH)"
	if n := defs["HALO_VERSION_NUMBER"]; n != formula {
		t.Errorf("include/halo.h: HALO_VERSION_NUMBER is %s, want %s", n, formula)
	}
	if part[1] > 99 || part[2] > 99 {
		t.Errorf("include/halo.h: minor %d and patch %d must be below 100 for HALO_VERSION_NUMBER", part[1], part[2])
	}
}
