package halo

import (
	"fmt"
	"testing"
	"time"
	"unsafe"
)

// Kernel throughput, for choosing implementations (bench/RESULTS.md).
func benchAdd(b *testing.B, d DType) {
	n := (2 << 20) / d.Size()
	dst, src := make([]byte, 2<<20), make([]byte, 2<<20)
	b.SetBytes(2 << 20)
	for i := 0; i < b.N; i++ {
		addInto(d, unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), n)
	}
}

func BenchmarkAdd2MiBFloat32(b *testing.B)  { benchKernels(b, Float32) }
func BenchmarkAdd2MiBFloat64(b *testing.B)  { benchKernels(b, Float64) }
func BenchmarkAdd2MiBFloat16(b *testing.B)  { benchKernels(b, Float16) }
func BenchmarkAdd2MiBBFloat16(b *testing.B) { benchKernels(b, BFloat16) }

// benchKernels times the additions with each kernel set a CPU may have:
// the fastest this one has, SSE2 only, and none.
func benchKernels(b *testing.B, d DType) {
	b.Run("best", func(b *testing.B) { benchAdd(b, d) })
	b.Run("sse2", func(b *testing.B) { withKernels(true, false, false, func() { benchAdd(b, d) }) })
	b.Run("scalar", func(b *testing.B) { withKernels(false, false, false, func() { benchAdd(b, d) }) })
}

func BenchmarkAddZero2MiBFloat32(b *testing.B) {
	dst := make([]byte, 2<<20)
	b.SetBytes(2 << 20)
	for i := 0; i < b.N; i++ {
		addZero(Float32, unsafe.Pointer(&dst[0]), len(dst)/4)
	}
}

func BenchmarkCopy2MiB(b *testing.B) {
	dst, src := make([]byte, 2<<20), make([]byte, 2<<20)
	b.SetBytes(2 << 20)
	for i := 0; i < b.N; i++ {
		copy(dst, src)
	}
}

// Packing short strided runs, the W halos of a tile (one run per row of
// the tile), as the executor does it (a walk, cpu.copy): 16 KiB of float32
// in runs of 1-64 elements, rows 96 elements apart, into a contiguous
// staging buffer (pack) and back (unpack). Each line reports the kernel's
// MB/s (ns/op) and, from rounds that alternate the three, the best MB/s of
// the kernel, of a memcpy of the same 16 KiB and of the former way (one
// memmove call per run), with the kernel's ratio to each: best of rounds,
// because the machine is shared.
func BenchmarkGather(b *testing.B) {
	const bytes, stride = 16 << 10, 96
	for _, run := range []int64{1, 2, 3, 4, 8, 16, 32, 64} {
		rows := bytes / 4 / run
		src := make([]float32, rows*stride)
		dst := make([]float32, rows*run)
		shape := []int64{rows, run}
		for _, dir := range []string{"pack", "unpack"} {
			b.Run(fmt.Sprintf("run=%d/%s", run, dir), func(b *testing.B) {
				d, s := unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0])
				ds, ss := ContiguousStrides(shape), []int64{stride, 1}
				if dir == "unpack" {
					d, s, ds, ss = s, d, ss, ds
				}
				w := newWalk(shape, [][]int64{ds, ss}, []int64{0, 0})
				b.SetBytes(bytes)
				for b.Loop() {
					cpu{}.copy(&w, 4, d, s)
				}
				plain := make([]byte, bytes)
				n := int(run) * 4
				best := bestRates(bytes, []func(){
					func() { cpu{}.copy(&w, 4, d, s) },
					func() { copy(plain, unsafe.Slice((*byte)(s), bytes)) },
					func() {
						for r := range rows {
							copy(unsafe.Slice((*byte)(unsafe.Add(d, r*ds[0]*4)), n), unsafe.Slice((*byte)(unsafe.Add(s, r*ss[0]*4)), n))
						}
					},
				})
				mb, memcpy, perRun := best[0], best[1], best[2]
				b.ReportMetric(mb, "best-MB/s")
				b.ReportMetric(memcpy, "memcpy-MB/s")
				b.ReportMetric(mb/memcpy, "x-memcpy")
				b.ReportMetric(mb/perRun, "x-memmove-per-run")
			})
		}
	}
}

// bestRates runs the functions in 21 alternating rounds of about 0.5 ms
// each and returns each one's best rate in MB/s of bytes per call.
func bestRates(bytes int, fns []func()) []float64 {
	best := make([]float64, len(fns))
	for range 21 {
		for i, fn := range fns {
			t0, n := time.Now(), 0
			for ; time.Since(t0) < 500*time.Microsecond; n++ {
				fn()
			}
			best[i] = max(best[i], float64(bytes)*float64(n)/time.Since(t0).Seconds()/1e6)
		}
	}
	return best
}

// Packing a channels-last halo for the wire (bench/RESULTS.md): the T halo
// of a (1, 32, T, 32, 32) channels_last_3d tensor, one slice of C x H x W =
// 32 x 1024 float32 (128 KiB) stored pixel-major, goes on the wire in
// logical (channel-major) order, a transpose; unpack is the reverse. Rows
// of single elements, each read (pack) or written (unpack) a cache line
// apart. Reports the best MB/s of alternating rounds beside a memcpy's.
func BenchmarkTransposePack(b *testing.B) {
	const C, HW = 32, 1024
	const bytes = 4 * C * HW
	shape := []int64{C, HW}
	wire, cl := ContiguousStrides(shape), []int64{1, C}
	src, dst := make([]float32, C*HW), make([]float32, C*HW)
	for _, dir := range []string{"pack", "unpack"} {
		b.Run(dir, func(b *testing.B) {
			ds, ss := wire, cl
			if dir == "unpack" {
				ds, ss = cl, wire
			}
			w := newWalk(shape, [][]int64{ds, ss}, []int64{0, 0})
			d, s := unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0])
			b.SetBytes(bytes)
			for b.Loop() {
				cpu{}.copy(&w, 4, d, s)
			}
			best := bestRates(bytes, []func(){
				func() { cpu{}.copy(&w, 4, d, s) },
				func() { copy(dst, src) },
			})
			b.ReportMetric(best[0], "best-MB/s")
			b.ReportMetric(best[1], "memcpy-MB/s")
			b.ReportMetric(best[0]/best[1], "x-memcpy")
		})
	}
}
