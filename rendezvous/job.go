package rendezvous

import "time"

// jobKey names a namespace. A new attempt of a job is a different namespace,
// so it can never read what an earlier attempt wrote.
type jobKey struct{ job, attempt string }

type entry struct {
	value []byte
	rank  int // who wrote it, for error messages
}

// job is the state of one (job, attempt). Every field is guarded by the
// server's mutex.
type job struct {
	key      jobKey
	size     int
	sizeFrom int // the rank whose hello fixed size
	values   map[string]entry
	bytes    int
	left     map[int]struct{}
	refs     int // sessions attached; a job with refs > 0 is never collected
	created  time.Time
	touched  time.Time
	failed   *ErrorReply // sticky: once set, every request in the job gets it
	failedAt time.Time
	failedCh chan struct{} // closed when failed is set
	// waiters holds, per missing key, the channels of the gets blocked on it.
	waiters map[string]map[chan struct{}]struct{}
	done    chan struct{} // closed when every rank has left
}

func newJob(key jobKey, size, sizeFrom int, now time.Time) *job {
	return &job{
		key:      key,
		size:     size,
		sizeFrom: sizeFrom,
		values:   make(map[string]entry),
		left:     make(map[int]struct{}),
		created:  now,
		touched:  now,
		failedCh: make(chan struct{}),
		waiters:  make(map[string]map[chan struct{}]struct{}),
		done:     make(chan struct{}),
	}
}

// wait registers a get blocked on key and returns the channel that written
// will close.
func (j *job) wait(key string) chan struct{} {
	ch := make(chan struct{})
	w := j.waiters[key]
	if w == nil {
		w = make(map[chan struct{}]struct{})
		j.waiters[key] = w
	}
	w[ch] = struct{}{}
	return ch
}

// unwait removes a registration made by wait for keys[next], if it is still
// there (written removes the ones it wakes).
func (j *job) unwait(keys []string, next int, ch chan struct{}) {
	if ch == nil || next >= len(keys) {
		return
	}
	if w := j.waiters[keys[next]]; w != nil {
		delete(w, ch)
		if len(w) == 0 {
			delete(j.waiters, keys[next])
		}
	}
}

// written wakes the gets waiting for key.
func (j *job) written(key string) {
	for ch := range j.waiters[key] {
		close(ch)
	}
	delete(j.waiters, key)
}

// fail makes the job fail for every rank, now and later, with the first
// reason given. It returns the reason that stuck.
func (j *job) fail(code Code, msg string) *ErrorReply {
	if j.failed == nil {
		j.failed = &ErrorReply{Code: code, Message: msg}
		j.failedAt = time.Now()
		close(j.failedCh)
	}
	return j.failed
}

// notLeft lists the ranks that have not left, in order.
func (j *job) notLeft() []int {
	var ranks []int
	for r := 0; r < j.size; r++ {
		if _, ok := j.left[r]; !ok {
			ranks = append(ranks, r)
		}
	}
	return ranks
}
