package rendezvous

import "time"

// jobKey names a namespace. A new attempt of a job is a different namespace,
// so it can never read what an earlier attempt wrote; so is another launch
// of the same job id and attempt.
type jobKey struct{ job, attempt, launch string }

type entry struct {
	value    []byte
	rank     int    // who wrote it, for error messages
	instance uint64 // the process that wrote it
}

// claim is who holds one rank of a job: the process (instance) whose hello
// took it, how many of its connections are open, whether it has left.
type claim struct {
	instance uint64
	remote   string // address of its first connection, for messages
	live     int
	left     bool
	gone     time.Time // when its last connection closed before it left
}

// job is the state of one (job, attempt, launch). Every field is guarded by
// the server's mutex.
type job struct {
	key      jobKey
	size     int
	sizeFrom int // the rank whose hello fixed size
	maxSize  int // the largest size any hello gave, for telling late ranks
	values   map[string]entry
	bytes    int
	claims   map[int]*claim
	left     map[int]struct{}
	told     map[int]struct{} // ranks that have received the job's failure
	refs     int              // sessions attached; a job with refs > 0 is never collected
	created  time.Time
	touched  time.Time
	failed   *ErrorReply // sticky: once set, every request in the job gets it
	failedAt time.Time
	failedCh chan struct{} // closed when failed is set
	// waiters holds, per missing key, the channels of the gets blocked on it.
	waiters map[string]map[chan struct{}]struct{}
	done    chan struct{} // closed when every rank has left
	// present holds the sessions of ranks that have left but keep their
	// connection open while they run (see session.leave): while any does,
	// the job is complete and alive, and a latecomer is refused.
	present map[*session]struct{}
	// events wakes the hosting rank when a rank goes away or is told of
	// a failure (one pending signal is enough).
	events chan struct{}
}

func newJob(key jobKey, size, sizeFrom int, now time.Time) *job {
	return &job{
		key:      key,
		size:     size,
		sizeFrom: sizeFrom,
		maxSize:  size,
		values:   make(map[string]entry),
		claims:   make(map[int]*claim),
		left:     make(map[int]struct{}),
		told:     make(map[int]struct{}),
		created:  now,
		touched:  now,
		failedCh: make(chan struct{}),
		waiters:  make(map[string]map[chan struct{}]struct{}),
		done:     make(chan struct{}),
		present:  make(map[*session]struct{}),
		events:   make(chan struct{}, 1),
	}
}

func (j *job) notify() {
	select {
	case j.events <- struct{}{}:
	default:
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
		j.notify()
	}
	return j.failed
}

// tell records that rank has been given the job's failure.
func (j *job) tell(rank int) {
	if _, ok := j.told[rank]; !ok && rank >= 0 {
		j.told[rank] = struct{}{}
		j.notify()
	}
}

// untold lists the ranks, up to the largest size any rank gave, that have
// neither been told of the job's failure nor left before it.
func (j *job) untold() []int {
	var ranks []int
	for r := 0; r < j.maxSize; r++ {
		_, told := j.told[r]
		_, left := j.left[r]
		if !told && !left {
			ranks = append(ranks, r)
		}
	}
	return ranks
}

// rankGone records that a rank's process went away without leaving.
func (j *job) rankGone(rank int, now time.Time) {
	if c := j.claims[rank]; c != nil {
		c.gone = now
	}
	j.notify()
}

// current reports whether key holds a value written by its rank's present
// holder. A value whose writer went away without leaving, or was replaced
// by a restarted process, must not reach a rank that asks later: the
// restart writes its own.
func (j *job) current(key string) bool {
	e, ok := j.values[key]
	if !ok {
		return false
	}
	c := j.claims[e.rank]
	return c != nil && c.instance == e.instance && (c.live > 0 || c.left || c.gone.IsZero())
}

// goneRanks lists the ranks whose process went away before leaving, at
// least grace ago, and the earliest such moment.
func (j *job) goneRanks(now time.Time, grace time.Duration) (ranks []int, since time.Time) {
	for r := 0; r < j.size; r++ {
		c := j.claims[r]
		if c == nil || c.left || c.live > 0 || c.gone.IsZero() || now.Sub(c.gone) < grace {
			continue
		}
		ranks = append(ranks, r)
		if since.IsZero() || c.gone.Before(since) {
			since = c.gone
		}
	}
	return ranks, since
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

// complete reports whether every rank has left with the result.
func (j *job) complete() bool {
	select {
	case <-j.done:
		return true
	default:
		return false
	}
}
