package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// handleName matches the names that hold a caller's handle rather than
// memory: CUDA streams, events and contexts, and the like.
var handleName = regexp.MustCompile(`(?i)^(s|s2|stream\w*|ev|event\w*|ctx|context|handle|user\w*)$`)

// A handle must never travel in a Go pointer type (unsafe.Pointer, *C.T):
// CUDA's default stream is 0x1, and Go's garbage collector aborts the
// process ("invalid pointer found on stack") when it finds such a value in
// a pointer slot. This walks the cgo packages that see handles: every
// parameter, result, variable and field with a handle's name, and every
// unsafe.Pointer(x) of one, must be a number; so must the handles of the C
// helpers that Go calls (cuda/driver.h), which cgo would turn into
// unsafe.Pointer if they were void *. (go vet's unsafeptr check, run by the
// go_vet_handles test, catches uintptr-to-pointer conversions beside this.)
func TestHandlesAreNumbers(t *testing.T) {
	fset := token.NewFileSet()
	for _, dir := range []string{".", "../cuda"} {
		files, _ := filepath.Glob(filepath.Join(dir, "*.go"))
		for _, path := range files {
			if strings.HasSuffix(path, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			ast.Inspect(f, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.Field:
					for _, name := range n.Names {
						if handleName.MatchString(name.Name) && pointerType(n.Type) {
							t.Errorf("%s: %s has a pointer type (%s); a handle must be a number (uintptr_t, C.uintptr_t)",
								fset.Position(name.Pos()), name.Name, typeString(n.Type))
						}
					}
				case *ast.ValueSpec:
					for _, name := range n.Names {
						if handleName.MatchString(name.Name) && n.Type != nil && pointerType(n.Type) {
							t.Errorf("%s: variable %s has a pointer type (%s); a handle must be a number",
								fset.Position(name.Pos()), name.Name, typeString(n.Type))
						}
					}
				case *ast.CallExpr:
					if typeString(n.Fun) == "unsafe.Pointer" && len(n.Args) == 1 {
						if id, ok := n.Args[0].(*ast.Ident); ok && handleName.MatchString(id.Name) {
							t.Errorf("%s: unsafe.Pointer(%s) makes a handle a pointer", fset.Position(n.Pos()), id.Name)
						}
					}
				}
				return true
			})
		}
	}
	h, err := os.ReadFile("../cuda/driver.h")
	if err != nil {
		t.Fatal(err)
	}
	voidHandle := regexp.MustCompile(`void\s*\*+\s*(ctx|ev|event|stream)\b`)
	for _, m := range voidHandle.FindAllString(string(h), -1) {
		t.Errorf("cuda/driver.h: %q: a handle Go passes or receives must be uintptr_t, not void *", m)
	}
}

func pointerType(e ast.Expr) bool {
	switch e := e.(type) {
	case *ast.StarExpr:
		// Pointers to Go values (a *cuda.Request) are real memory; pointers
		// into C's types are where a handle would hide.
		sel, ok := e.X.(*ast.SelectorExpr)
		return ok && typeString(sel.X) == "C" || typeString(e.X) == "unsafe.Pointer"
	case *ast.SelectorExpr:
		return typeString(e) == "unsafe.Pointer"
	}
	return false
}

func typeString(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name
	case *ast.SelectorExpr:
		return typeString(e.X) + "." + e.Sel.Name
	case *ast.StarExpr:
		return "*" + typeString(e.X)
	}
	return "?"
}
