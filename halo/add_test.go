package halo

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"math"
	"math/rand"
	"os"
	"slices"
	"testing"
	"unsafe"
)

// The vector kernels must give exactly the scalar results, for every class
// of value (NaN, infinities, -0, subnormals, rounding ties) and any length,
// with each set of kernels a CPU may have.
func TestAddKernelsMatchScalar(t *testing.T) {
	checkAddKernels(t, "AVX2 and F16C")
	withKernels(true, false, false, func() { checkAddKernels(t, "SSE2") })
}

func checkAddKernels(t *testing.T, mode string) {
	rng := rand.New(rand.NewSource(8))
	special16 := []uint16{0, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffff, 0x0001, 0x8001, 0x3f80, 0x3f81, 0x7f7f}
	special32 := []uint32{0, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0x00000001, 0x80000001, 0x3f800000, 0x7f7fffff}
	for it := 0; it < 300; it++ {
		n := rng.Intn(70)
		a16, b16 := make([]uint16, n), make([]uint16, n)
		a32, b32 := make([]uint32, n), make([]uint32, n)
		for i := 0; i < n; i++ {
			a16[i], b16[i] = uint16(rng.Uint32()), uint16(rng.Uint32())
			a32[i], b32[i] = rng.Uint32(), rng.Uint32()
			if rng.Intn(4) == 0 {
				a16[i] = special16[rng.Intn(len(special16))]
				b32[i] = special32[rng.Intn(len(special32))]
			}
			if rng.Intn(4) == 0 { // same exponent: exercises ties and cancellation
				b16[i] = a16[i] ^ uint16(rng.Intn(256))
				a32[i] = b32[i] ^ uint32(rng.Intn(1<<16))
			}
		}
		a64, b64 := make([]float64, n), make([]float64, n)
		for i := range a64 {
			a64[i], b64[i] = math.Float64frombits(rng.Uint64()), math.Float64frombits(uint64(b32[i])<<32|uint64(a32[i]))
		}
		want16 := make([]uint16, n)
		want32 := make([]uint32, n)
		want64 := make([]float64, n)
		for i := 0; i < n; i++ {
			want16[i] = F32ToBF16(BF16ToF32(a16[i]) + BF16ToF32(b16[i]))
			want32[i] = math.Float32bits(math.Float32frombits(a32[i]) + math.Float32frombits(b32[i]))
			want64[i] = a64[i] + b64[i]
		}
		if n > 0 {
			addInto(BFloat16, unsafe.Pointer(&a16[0]), unsafe.Pointer(&b16[0]), n)
			addInto(Float32, unsafe.Pointer(&a32[0]), unsafe.Pointer(&b32[0]), n)
			addInto(Float64, unsafe.Pointer(&a64[0]), unsafe.Pointer(&b64[0]), n)
		}
		for i := 0; i < n; i++ {
			if a16[i] != want16[i] {
				t.Fatalf("%s: bfloat16 n=%d [%d]: %#x, want %#x", mode, n, i, a16[i], want16[i])
			}
			if a32[i] != want32[i] {
				t.Fatalf("%s: float32 n=%d [%d]: %#x, want %#x", mode, n, i, a32[i], want32[i])
			}
			if got, want := math.Float64bits(a64[i]), math.Float64bits(want64[i]); got != want {
				t.Fatalf("%s: float64 n=%d [%d]: %#x, want %#x", mode, n, i, got, want)
			}
		}
	}
}

// addZero over long arrays takes the vector path: same bits as adding +0.
func TestAddZeroVectorPath(t *testing.T) {
	all := make([]uint16, 1<<16)
	for i := range all {
		all[i] = uint16(i)
	}
	addZero(BFloat16, unsafe.Pointer(&all[0]), len(all))
	for i, got := range all {
		if want := F32ToBF16(BF16ToF32(uint16(i)) + 0); got != want {
			t.Fatalf("bfloat16 %#x + 0 = %#x, want %#x", i, got, want)
		}
	}
	rng := rand.New(rand.NewSource(9))
	f := make([]uint32, 10007)
	for i := range f {
		f[i] = rng.Uint32()
	}
	f[5], f[6], f[7] = 0x80000000, 0x7f800001, 0xff800000
	want := make([]uint32, len(f))
	for i, v := range f {
		want[i] = math.Float32bits(math.Float32frombits(v) + 0)
	}
	addZero(Float32, unsafe.Pointer(&f[0]), len(f))
	for i := range f {
		if f[i] != want[i] {
			t.Fatalf("float32 [%d] %#x, want %#x", i, f[i], want[i])
		}
	}
}

// halfAddGolden is testdata/half_add.json, written by torch (half_add.py).
type halfAddGolden struct {
	B      []uint16   `json:"b"`
	SHA256 string     `json:"sha256"`
	Table  [][]uint16 `json:"table"`
}

// withKernels runs fn with only the kernels named on, as on a CPU that has
// only those (or none; AVX goes with AVX2).
func withKernels(sse2, avx2, f16c bool, fn func()) {
	saved := kernels
	kernels.sse2, kernels.avx, kernels.avx2, kernels.f16c = sse2, avx2, avx2, f16c
	defer func() { kernels = saved }()
	fn()
}

// The half-precision additions give torch's bits for every pattern a
// against a set of b's (specials, subnormals, ties, NaNs of both signs and
// several payloads), with the vector kernels and with the scalar fallback,
// at lengths that take the vector body and the scalar tail.
// (On a CPU without AVX2 or F16C the first check repeats a later one.)
func TestHalfAddMatchesTorch(t *testing.T) {
	raw, err := os.ReadFile("testdata/half_add.json")
	if err != nil {
		t.Fatal(err)
	}
	var golden map[string]json.RawMessage
	if err := json.Unmarshal(raw, &golden); err != nil {
		t.Fatal(err)
	}
	for _, d := range []DType{Float16, BFloat16} {
		var g halfAddGolden
		if err := json.Unmarshal(golden[d.String()], &g); err != nil {
			t.Fatal(err)
		}
		check := func(mode string) {
			for i, a := range g.B {
				row := slices.Repeat([]uint16{a}, len(g.B))
				addInto(d, unsafe.Pointer(&row[0]), unsafe.Pointer(&g.B[0]), len(row))
				for j, want := range g.Table[i] {
					if row[j] != want {
						t.Fatalf("%v %s: %#04x + %#04x = %#04x, torch %#04x", d, mode, a, g.B[j], row[j], want)
					}
				}
			}
			h := sha256.New()
			sum := make([]uint16, 1<<16)
			src := make([]uint16, 1<<16)
			for _, b := range g.B {
				for i := range sum {
					sum[i], src[i] = uint16(i), b
				}
				for done, n := 0, 1; done < len(sum); done, n = done+n, n%67+1 { // ragged pieces: bodies and tails
					n = min(n, len(sum)-done)
					addInto(d, unsafe.Pointer(&sum[done]), unsafe.Pointer(&src[done]), n)
				}
				binary.Write(h, binary.LittleEndian, sum)
			}
			if got := hex.EncodeToString(h.Sum(nil)); got != g.SHA256 {
				t.Errorf("%v %s: the sums of every pattern with the b's of testdata/half_add.json differ from torch's (sha256 %s, torch %s)", d, mode, got, g.SHA256)
			}
		}
		check("AVX2 and F16C")
		withKernels(true, false, false, func() { check("SSE2") })
		withKernels(false, false, false, func() { check("scalar") })
	}
}
