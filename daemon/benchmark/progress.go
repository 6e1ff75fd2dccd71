package benchmark

import (
	"io"
	"strings"

	"github.com/schollz/progressbar/v3"
)

// Progress is rank 0's progress bar on stderr; a nil *Progress does
// nothing, which is what every other rank and a non-terminal get.
type Progress struct {
	w   io.Writer
	bar *progressbar.ProgressBar
}

// NewProgress returns a bar on w for mode auto (when terminal), on or off.
func NewProgress(w io.Writer, mode string, terminal bool) *Progress {
	switch strings.ToLower(mode) {
	case "on":
	case "off":
		return nil
	default:
		if !terminal {
			return nil
		}
	}
	return &Progress{w: w}
}

// Start shows a new bar of n steps.
func (p *Progress) Start(n int, what string) {
	if p == nil {
		return
	}
	p.bar = progressbar.NewOptions(n,
		progressbar.OptionSetWriter(p.w),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowCount(),
		progressbar.OptionSetWidth(30),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionSetPredictTime(false),
		progressbar.OptionThrottle(0),
	)
	p.bar.RenderBlank()
}

// Set moves the bar to done steps.
func (p *Progress) Set(done int) {
	if p != nil && p.bar != nil {
		p.bar.Set(done)
	}
}

// clear wipes the bar before a table row is printed on the same terminal;
// the next set draws it again below the row.
func (p *Progress) clear() {
	if p != nil && p.bar != nil {
		p.bar.Clear()
	}
}

// Finish removes the bar.
func (p *Progress) Finish() {
	if p != nil && p.bar != nil {
		p.bar.Finish()
		p.bar.Clear()
		p.bar = nil
	}
}
