//! One request's state machine between prepXfer and releaseReqH: idle, running (ops handed out,
//! outstanding, written inline), done or failed. Pure bookkeeping: no I/O and no locks here.

use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::uring::{IoOp, Progress};

/// Buffered writes of one request that may sit in io_uring at once. io_uring's workers run
/// buffered writes to one file one after another, so a few keep them busy; the rest are left for
/// the threads that post and poll, which write them directly.
const RING_WRITES_PER_REQUEST: usize = 4;

/// The ops of one prepared request.
#[derive(Debug)]
pub struct RequestOps {
    pub write: bool,
    pub ops: Vec<IoOp>,
    /// Every op is a buffered write from host memory: the calling threads may write them
    /// themselves (see `Driver::help_with_writes`).
    pub inline_writes: bool,
    /// Every op is a buffered read into host memory: a small request may be served from the
    /// page cache by the posting thread (see `Driver::read_inline_if_cached`).
    pub inline_reads: bool,
    /// Every op's file is a page-cache file (no O_DIRECT): staged WRITEs count against the
    /// staging write window (`path::staging::StagingShape::write_window`).
    pub page_cache: bool,
}

#[derive(Debug)]
enum State {
    Idle,
    Running {
        /// Ops handed out so far (to the ring or to an inline writer).
        next: usize,
        /// Ops not finished yet (including those never handed out).
        outstanding: usize,
        /// Ops being written inline by some thread right now.
        inline_active: usize,
        error: Option<Error>,
        abort: bool,
    },
    Done,
    Failed(Error),
}

/// What the next op of a running request is, for the ring's fill loop.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Nothing more to hand out (all handed out, failing, or not running).
    Nothing,
    /// Enough of this request's buffered writes are in the ring; let other requests go first.
    Throttled,
    Op(IoOp),
}

/// What a storage result means for its op.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// All bytes moved.
    Complete,
    /// Short or retryable: this op (the remainder) goes again.
    Retry(IoOp),
    /// The op is over without success (the error, if any, is recorded).
    Over,
}

/// A request and its progress.
#[derive(Debug)]
pub struct RequestProgress {
    pub ops: Arc<RequestOps>,
    state: State,
    /// Retryable errors (EAGAIN, EINTR, ECANCELED) in a row with no byte moved in between.
    stalled_retries: u32,
}

/// Past this many retries in a row without progress the request fails with the last errno
/// instead of reissuing forever (a device or kernel that answers EAGAIN for good).
const MAX_STALLED_RETRIES: u32 = 100_000;

impl RequestProgress {
    pub fn new(ops: Arc<RequestOps>) -> RequestProgress {
        RequestProgress {
            ops,
            state: State::Idle,
            stalled_retries: 0,
        }
    }

    /// Starts (or restarts) the request. Some(Done) when there is nothing to do.
    pub fn start(&mut self) -> Result<Option<Progress>> {
        if self.is_running() {
            return Err(Error::new(
                ErrorKind::RepostActive,
                "postXfer: the request is still in flight; wait for it or release it",
            ));
        }
        let total = self.ops.ops.len();
        self.stalled_retries = 0;
        if total == 0 {
            self.state = State::Done;
            return Ok(Some(Progress::Done));
        }
        self.state = State::Running {
            next: 0,
            outstanding: total,
            inline_active: 0,
            error: None,
            abort: false,
        };
        Ok(None)
    }

    pub fn is_running(&self) -> bool {
        matches!(self.state, State::Running { .. })
    }

    /// Whether the request's ops should still go ahead.
    pub fn is_healthy(&self) -> bool {
        matches!(
            self.state,
            State::Running {
                error: None,
                abort: false,
                ..
            }
        )
    }

    /// The state as a post/check result.
    pub fn status(&self) -> Result<Progress> {
        match &self.state {
            State::Idle => Err(Error::new(
                ErrorKind::InvalidParam,
                "checkXfer on a request that was never posted",
            )),
            State::Running { .. } => Ok(Progress::InFlight),
            State::Done => Ok(Progress::Done),
            State::Failed(e) => Err(e.clone()),
        }
    }

    /// The next op to hand to the ring (see [`Next`]); [`RequestProgress::advance`] takes it.
    pub fn peek_next(&self) -> Next {
        let total = self.ops.ops.len();
        let State::Running {
            next,
            outstanding,
            inline_active,
            error: None,
            abort: false,
        } = self.state
        else {
            return Next::Nothing;
        };
        if next >= total {
            return Next::Nothing;
        }
        if self.ops.inline_writes
            && next - (total - outstanding) - inline_active >= RING_WRITES_PER_REQUEST
        {
            return Next::Throttled;
        }
        Next::Op(self.ops.ops[next])
    }

    /// Takes the op `peek_next` returned. True when it was the last one.
    pub fn advance(&mut self) -> bool {
        let total = self.ops.ops.len();
        if let State::Running { next, .. } = &mut self.state {
            *next += 1;
            return *next >= total;
        }
        true
    }

    /// Records the first error and stops the ops not handed out yet.
    pub fn fail(&mut self, e: Error) {
        if let State::Running { error, .. } = &mut self.state {
            if error.is_none() {
                *error = Some(e);
            }
        }
        self.stop_if_failing();
    }

    /// Marks the request aborted (release while in flight): nothing more is handed out.
    pub fn abort(&mut self) {
        if let State::Running { abort, .. } = &mut self.state {
            *abort = true;
        }
        self.settle();
    }

    /// One op is over (done, failed or dropped).
    pub fn op_over(&mut self) {
        if let State::Running { outstanding, .. } = &mut self.state {
            *outstanding -= 1;
        }
        self.finish_if_drained();
    }

    /// Classifies the storage result `res` (bytes moved or -errno) of `op` and records errors.
    /// The caller releases the op's resources and calls `op_over` for `Complete` and `Over`.
    pub fn on_result(&mut self, op: &IoOp, res: i32) -> Outcome {
        let write = self.ops.write;
        if res > 0 {
            self.stalled_retries = 0;
        }
        let stalled = &mut self.stalled_retries;
        let State::Running { error, abort, .. } = &mut self.state else {
            return Outcome::Over;
        };
        if res >= 0 && res as u32 == op.len {
            Outcome::Complete
        } else if res > 0 && *abort {
            // Being released: nothing more is issued, so release waits for no remainder.
            Outcome::Over
        } else if res > 0 {
            // Short transfer: finish the remainder (NIXL's POSIX fails the request here).
            Outcome::Retry(op.remainder(res as u32))
        } else if res == 0 {
            if error.is_none() {
                *error = Some(op.made_no_progress(write));
            }
            Outcome::Over
        } else {
            let errno = -res;
            // EAGAIN includes the spurious ones of DMA-BUF slots (mapping invalidated by the
            // exporter), which the series asks users to reissue (v3 10/10, checked up to v7).
            let retryable = errno == libc::EAGAIN
                || errno == libc::EINTR
                || (errno == libc::ECANCELED && !*abort);
            *stalled += u32::from(retryable);
            if retryable && error.is_none() && !*abort && *stalled <= MAX_STALLED_RETRIES {
                Outcome::Retry(*op)
            } else {
                if error.is_none() && !*abort {
                    let mut e = op.failed(write, errno);
                    if retryable {
                        e.message.push_str(&format!(
                            " after {MAX_STALLED_RETRIES} retries in a row without progress"
                        ));
                    }
                    *error = Some(e);
                }
                Outcome::Over
            }
        }
    }

    /// After any change: a failing request drops its unsubmitted ops, a drained one ends.
    pub fn settle(&mut self) {
        self.stop_if_failing();
        self.finish_if_drained();
    }

    /// Hands up to `budget` bytes of not-yet-started ops to an inline writer: the range of ops.
    pub fn take_inline_writes(&mut self, budget: u64) -> Option<(usize, usize)> {
        if budget == 0 || !self.ops.inline_writes {
            return None;
        }
        let ops = &self.ops.ops;
        let State::Running {
            next,
            inline_active,
            error: None,
            abort: false,
            ..
        } = &mut self.state
        else {
            return None;
        };
        let (start, mut end, mut bytes) = (*next, *next, 0u64);
        while end < ops.len() && bytes < budget {
            bytes += ops[end].len as u64;
            end += 1;
        }
        if end == start {
            return None;
        }
        *next = end;
        *inline_active += end - start;
        Some((start, end))
    }

    /// An inline writer finished `n` ops with `result`.
    pub fn inline_writes_done(&mut self, n: usize, result: Result<()>) {
        if let State::Running {
            outstanding,
            inline_active,
            ..
        } = &mut self.state
        {
            *outstanding -= n;
            *inline_active -= n;
        }
        if let Err(e) = result {
            self.fail(e);
        }
        self.finish_if_drained();
    }

    /// Hands every op to an inline reader if none was handed out yet: how many.
    pub fn take_inline_read(&mut self) -> Option<usize> {
        let n = self.ops.ops.len();
        let State::Running {
            next: next @ 0,
            inline_active,
            error: None,
            abort: false,
            ..
        } = &mut self.state
        else {
            return None;
        };
        *next = n;
        *inline_active += n;
        Some(n)
    }

    /// The inline reader served the first `done` of its `n` ops; the rest go to the ring.
    pub fn inline_read_done(&mut self, n: usize, done: usize) {
        if let State::Running {
            next,
            outstanding,
            inline_active,
            ..
        } = &mut self.state
        {
            *inline_active -= n;
            *outstanding -= done;
            *next = done;
        }
        // A release that came meanwhile drops the ops not read.
        self.settle();
    }

    fn stop_if_failing(&mut self) {
        let total = self.ops.ops.len();
        if let State::Running {
            next,
            outstanding,
            error,
            abort,
            ..
        } = &mut self.state
        {
            if (error.is_some() || *abort) && *next < total {
                *outstanding -= total - *next;
                *next = total;
            }
        }
    }

    fn finish_if_drained(&mut self) {
        if let State::Running {
            outstanding: 0,
            error,
            abort,
            ..
        } = &mut self.state
        {
            self.state = if *abort {
                State::Failed(Error::new(
                    ErrorKind::Canceled,
                    "request released while in flight",
                ))
            } else if let Some(e) = error.take() {
                State::Failed(e)
            } else {
                State::Done
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uring::FileRef;

    fn request(n: usize, write: bool, inline_writes: bool) -> RequestProgress {
        let op = |i: usize| IoOp {
            file: FileRef::Raw(3),
            fd: 3,
            io_fd: 3,
            file_offset: i as u64 * 4096,
            addr: 0x10000 + i as u64 * 4096,
            len: 4096,
            buf_index: None,
            device: None,
            punt: false,
            desc_index: i as u32,
        };
        RequestProgress::new(Arc::new(RequestOps {
            write,
            ops: (0..n).map(op).collect(),
            inline_writes,
            inline_reads: false,
            page_cache: true,
        }))
    }

    fn run_all(r: &mut RequestProgress) -> Vec<IoOp> {
        let mut out = Vec::new();
        while let Next::Op(op) = r.peek_next() {
            r.advance();
            out.push(op);
        }
        out
    }

    #[test]
    fn ops_complete_and_the_request_is_done() {
        let mut r = request(3, false, false);
        assert_eq!(r.status().unwrap_err().kind, ErrorKind::InvalidParam);
        assert_eq!(r.start().unwrap(), None);
        let ops = run_all(&mut r);
        assert_eq!(ops.len(), 3);
        for op in &ops {
            assert_eq!(r.status().unwrap(), Progress::InFlight);
            assert_eq!(r.on_result(op, 4096), Outcome::Complete);
            r.op_over();
            r.settle();
        }
        assert_eq!(r.status().unwrap(), Progress::Done);
    }

    #[test]
    fn a_repost_while_running_is_refused_and_an_empty_request_is_done_at_once() {
        let mut r = request(1, false, false);
        r.start().unwrap();
        assert_eq!(r.start().unwrap_err().kind, ErrorKind::RepostActive);
        let mut empty = request(0, false, false);
        assert_eq!(empty.start().unwrap(), Some(Progress::Done));
    }

    #[test]
    fn short_io_retries_the_remainder_and_eof_fails() {
        let mut r = request(1, false, false);
        r.start().unwrap();
        let op = run_all(&mut r)[0];
        let Outcome::Retry(rest) = r.on_result(&op, 1000) else {
            panic!("short read must retry")
        };
        assert_eq!((rest.file_offset, rest.len), (1000, 3096));
        assert_eq!(r.on_result(&rest, 0), Outcome::Over);
        r.op_over();
        r.settle();
        assert!(r
            .status()
            .unwrap_err()
            .message
            .contains("read past end of file"));
    }

    #[test]
    fn an_error_stops_the_ops_not_handed_out() {
        let mut r = request(4, true, false);
        r.start().unwrap();
        let Next::Op(first) = r.peek_next() else {
            panic!()
        };
        r.advance();
        assert_eq!(r.on_result(&first, -libc::EIO), Outcome::Over);
        r.op_over();
        r.settle();
        assert_eq!(r.peek_next(), Next::Nothing);
        assert!(r.status().unwrap_err().message.contains("write to fd 3"));
    }

    #[test]
    fn eagain_forever_fails_the_request_instead_of_spinning() {
        let mut r = request(1, false, false);
        r.start().unwrap();
        let ops = run_all(&mut r);
        for _ in 0..MAX_STALLED_RETRIES {
            assert_eq!(r.on_result(&ops[0], -libc::EAGAIN), Outcome::Retry(ops[0]));
        }
        assert_eq!(r.on_result(&ops[0], -libc::EAGAIN), Outcome::Over);
        r.op_over();
        r.settle();
        let e = r.status().unwrap_err();
        assert!(
            e.message.contains("retries in a row without progress"),
            "{}",
            e.message
        );
        assert_eq!(e.context.errno, Some(libc::EAGAIN));
        // A repost starts counting again, and any byte moved resets the count.
        r.start().unwrap();
        let ops = run_all(&mut r);
        for _ in 0..MAX_STALLED_RETRIES {
            assert_eq!(r.on_result(&ops[0], -libc::EAGAIN), Outcome::Retry(ops[0]));
        }
        let rest = ops[0].remainder(1);
        assert_eq!(r.on_result(&ops[0], 1), Outcome::Retry(rest));
        assert_eq!(r.on_result(&rest, -libc::EAGAIN), Outcome::Retry(rest));
    }

    #[test]
    fn eagain_retries_but_not_after_an_abort() {
        let mut r = request(2, false, false);
        r.start().unwrap();
        let ops = run_all(&mut r);
        assert_eq!(r.on_result(&ops[0], -libc::EAGAIN), Outcome::Retry(ops[0]));
        r.abort();
        assert_eq!(r.on_result(&ops[0], -libc::ECANCELED), Outcome::Over);
        r.op_over();
        assert_eq!(r.on_result(&ops[1], 4096), Outcome::Complete);
        r.op_over();
        r.settle();
        assert_eq!(r.status().unwrap_err().kind, ErrorKind::Canceled);
    }

    #[test]
    fn buffered_writes_are_throttled_in_the_ring_and_shared_with_inline_writers() {
        let mut r = request(10, true, true);
        r.start().unwrap();
        assert_eq!(r.take_inline_writes(2 * 4096), Some((0, 2)));
        for _ in 0..RING_WRITES_PER_REQUEST {
            assert!(matches!(r.peek_next(), Next::Op(_)));
            r.advance();
        }
        assert_eq!(r.peek_next(), Next::Throttled);
        r.inline_writes_done(2, Ok(()));
        assert_eq!(r.peek_next(), Next::Throttled);
        assert_eq!(r.take_inline_writes(1 << 20), Some((6, 10)));
        assert_eq!(r.peek_next(), Next::Nothing);
    }

    #[test]
    fn an_inline_read_hands_back_what_it_did_not_serve() {
        let mut r = request(3, false, false);
        r.start().unwrap();
        assert_eq!(r.take_inline_read(), Some(3));
        assert_eq!(r.take_inline_read(), None);
        r.inline_read_done(3, 1);
        let rest = run_all(&mut r);
        assert_eq!(
            rest.iter().map(|o| o.desc_index).collect::<Vec<_>>(),
            [1, 2]
        );
    }
}
