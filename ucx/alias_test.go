package ucx

import "github.com/halo-cp/halo/halo/transport"

// Short names for the shared operation types in this package's tests.
type (
	Op      = transport.Op
	Segment = transport.Segment
)
