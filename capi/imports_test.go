package main

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"testing"
)

// The architecture as a test (as tests/python/test_imports.py for halocp):
// capi translates the C ABI to comm and halo; the stream-ordered proxy, the
// requests and the CUDA driver are comm's, so capi never imports cuda.
func TestCapiImportsNoCUDA(t *testing.T) {
	forbidden := map[string]string{
		"github.com/halo-cp/halo/cuda": "the proxy and the requests belong to comm (comm/requests.go)",
		"github.com/halo-cp/halo/ucx":  "the transport is comm's",
	}
	files, err := filepath.Glob("*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no Go files in capi (%v)", err)
	}
	fset := token.NewFileSet()
	for _, name := range files {
		f, err := parser.ParseFile(fset, name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if why, bad := forbidden[path]; bad {
				t.Errorf("capi/%s imports %s: %s", name, path, why)
			}
		}
	}
}
