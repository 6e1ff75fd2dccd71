package halo

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// The package's shape, read from its source (issue 34 §3): a type is
// declared in one file and has methods in at most one more, under one
// receiver name; no two constants differ only in their first letter's
// case (CallForward and callForward read alike and meant different
// values); Plan's exported methods are the list below.

// sourceFiles parses the package's non-test files.
func sourceFiles(t *testing.T) map[string]*ast.File {
	t.Helper()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset, files := token.NewFileSet(), map[string]*ast.File{}
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if files[name], err = parser.ParseFile(fset, name, src, parser.SkipObjectResolution); err != nil {
			t.Fatal(err)
		}
	}
	return files
}

// receiverType is the name of a method's receiver type (T of *T, T[X]).
func receiverType(e ast.Expr) string {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.IndexExpr:
			e = x.X
		case *ast.IndexListExpr:
			e = x.X
		case *ast.ParenExpr:
			e = x.X
		case *ast.Ident:
			return x.Name
		default:
			return ""
		}
	}
}

func TestTypesLiveInAtMostTwoFiles(t *testing.T) {
	files := sourceFiles(t)
	where := map[string][]string{}     // type -> the files that declare it or its methods
	receivers := map[string][]string{} // type -> "name (file: method)", one per receiver name
	add := func(typ, file string) {
		if !slices.Contains(where[typ], file) {
			where[typ] = append(where[typ], file)
		}
	}
	for _, file := range slices.Sorted(maps.Keys(files)) {
		for _, d := range files[file].Decls {
			switch d := d.(type) {
			case *ast.GenDecl:
				for _, s := range d.Specs {
					if ts, ok := s.(*ast.TypeSpec); ok {
						add(ts.Name.Name, file)
					}
				}
			case *ast.FuncDecl:
				if d.Recv == nil || len(d.Recv.List) == 0 {
					continue
				}
				r := d.Recv.List[0]
				typ := receiverType(r.Type)
				add(typ, file)
				recv := "(unnamed)"
				if len(r.Names) > 0 {
					recv = r.Names[0].Name
				}
				if !slices.ContainsFunc(receivers[typ], func(s string) bool { return strings.HasPrefix(s, recv+" ") }) {
					receivers[typ] = append(receivers[typ], recv+" ("+file+": "+d.Name.Name+")")
				}
			}
		}
	}
	for _, typ := range slices.Sorted(maps.Keys(where)) {
		if fs := where[typ]; len(fs) > 2 {
			t.Errorf("type %s is declared or has methods in %d files (%s): keep it to its own file and at most one more",
				typ, len(fs), strings.Join(fs, ", "))
		}
		if rs := receivers[typ]; len(rs) > 1 {
			t.Errorf("type %s has %d receiver names: %s", typ, len(rs), strings.Join(rs, ", "))
		}
	}
}

func TestConstantsDoNotDifferByCaseAlone(t *testing.T) {
	seen := map[string]string{} // lower-cased name -> name, file
	files := sourceFiles(t)
	for _, name := range slices.Sorted(maps.Keys(files)) {
		for _, d := range files[name].Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok || g.Tok != token.CONST {
				continue
			}
			for _, s := range g.Specs {
				for _, id := range s.(*ast.ValueSpec).Names {
					key := strings.ToLower(id.Name)
					if other, ok := seen[key]; ok && !strings.HasPrefix(other, id.Name+" ") {
						t.Errorf("constants %s (%s) and %s differ only in case", id.Name, name, other)
					}
					seen[key] = id.Name + " (" + name + ")"
				}
			}
		}
	}
}

// planMethods is Plan's exported face: one call for every exchange (Do,
// DoMulti, by Call) and its finish, no named wrapper per call (issue 34
// removed 16 of them that only tests used). A method added here is a
// decision: one that duplicates Do is not.
var planMethods = []string{
	"Close", "Do", "DoMulti", "ID", "InFlight", "Lengths", "Messages", "Rank", "Spec", "Specs", "Test", "Wait", "WireBytes",
}

func TestPlanMethodsAreTheList(t *testing.T) {
	typ := reflect.TypeFor[*Plan]()
	var have []string
	for i := range typ.NumMethod() {
		have = append(have, typ.Method(i).Name)
	}
	for _, m := range have {
		if !slices.Contains(planMethods, m) {
			t.Errorf("Plan has exported method %s, not in planMethods (structure_test.go): call Do or DoMulti, or add it there with a reason", m)
		}
	}
	for _, m := range planMethods {
		if !slices.Contains(have, m) {
			t.Errorf("planMethods lists %s, which Plan no longer has: take it off the list", m)
		}
	}
}
