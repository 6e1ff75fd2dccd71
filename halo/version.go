package halo

// Version is the library version. include/halo.h's HALO_VERSION_* macros are
// the source; version_test.go checks this copy against them.
const Version = "0.1.0"
