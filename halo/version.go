package halo

// Version is the library version, a copy of include/halo.h's HALO_VERSION_*
// macros: the header is the source (CMake reads it too). TestVersionMatchesHeader
// in version_test.go fails when this copy drifts; capi's TestABIConstants
// checks it against HALO_VERSION_STRING through cgo as well.
const Version = "0.4.0"
