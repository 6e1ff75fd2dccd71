package ucx

import "testing"

func TestResources(t *testing.T) {
	rs, err := Resources()
	if err != nil {
		t.Fatal(err)
	}
	self := false
	for _, r := range rs {
		t.Logf("%+v", r)
		if r.Transport == "" || r.Device == "" {
			t.Errorf("resource with an empty name: %+v", r)
		}
		self = self || r.Transport == "self"
	}
	if !self {
		t.Errorf("no self transport among %d resources (UCX always has one)", len(rs))
	}
}
