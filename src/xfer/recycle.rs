//! Op lists handed back by released requests, kept for the next prepXfer.
//!
//! A request of 8192 KV blocks plans about 450 KiB of ops. Freed, that block goes back to the
//! kernel (glibc trims the heap's top or unmaps a large chunk), and the next prepXfer faults the
//! same pages in again, zeroed: perf put page faults and brk at a sixth of the plugin's prep
//! time on the 2-CPU machine. Clients prepare a request per job, so a few lists kept here
//! serve them without a fault.

use std::sync::Mutex;

use crate::uring::IoOp;

/// Lists kept at most (requests released while others are prepared).
const KEPT: usize = 4;
/// Larger lists are not kept (4 x 64 Ki ops is about 15 MiB held at most).
const KEPT_OPS_MAX: usize = 1 << 16;

/// Cleared op lists with their capacity, for `plan` to fill again.
#[derive(Default)]
pub struct OpLists {
    kept: Mutex<Vec<Vec<IoOp>>>,
}

impl OpLists {
    /// An empty list with room for at least `ops` ops, reused when one is kept.
    pub fn take(&self, ops: usize) -> Vec<IoOp> {
        // A poisoned lock only loses the reuse: the kept lists are plain memory.
        let reused = self.kept.lock().ok().and_then(|mut k| k.pop());
        let mut list = reused.unwrap_or_default();
        list.reserve(ops);
        list
    }

    /// Keeps a released request's list for a later `take`, if there is room.
    pub fn give_back(&self, mut list: Vec<IoOp>) {
        if list.capacity() > KEPT_OPS_MAX {
            return;
        }
        list.clear();
        if let Ok(mut kept) = self.kept.lock() {
            if kept.len() < KEPT {
                kept.push(list);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uring::FileRef;

    fn op() -> IoOp {
        IoOp {
            file: FileRef::Raw(3),
            fd: 3,
            io_fd: 3,
            file_offset: 0,
            addr: 0,
            len: 4096,
            buf_index: None,
            device: None,
            punt: false,
            desc_index: 0,
        }
    }

    #[test]
    fn a_given_back_list_comes_back_empty_with_its_memory() {
        let lists = OpLists::default();
        let mut a = lists.take(8192);
        a.resize(8192, op());
        let at = a.as_ptr();
        lists.give_back(a);
        let b = lists.take(100);
        assert!(b.is_empty());
        assert_eq!(b.as_ptr(), at, "the same allocation is reused");
        assert!(b.capacity() >= 8192);
    }

    #[test]
    fn only_a_few_lists_of_bounded_size_are_kept() {
        let lists = OpLists::default();
        for _ in 0..KEPT + 3 {
            lists.give_back(Vec::with_capacity(16));
        }
        lists.give_back(Vec::with_capacity(KEPT_OPS_MAX + 1));
        assert_eq!(lists.kept.lock().unwrap().len(), KEPT);
        assert!(lists
            .kept
            .lock()
            .unwrap()
            .iter()
            .all(|l| l.capacity() <= KEPT_OPS_MAX));
    }
}
