//! Free-list of indices into one of the ring's sparse tables (fixed buffers, fixed files).

/// Hands out indices `0..capacity`, lowest first, and takes them back.
#[derive(Debug)]
pub struct SlotPool {
    free: Vec<u32>,
}

impl SlotPool {
    pub fn new(capacity: u32) -> Self {
        SlotPool {
            free: (0..capacity).rev().collect(),
        }
    }

    pub fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub fn put(&mut self, slot: u32) {
        debug_assert!(!self.free.contains(&slot), "slot {slot} released twice");
        self.free.push(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_after_release_and_run_out_at_capacity() {
        let mut p = SlotPool::new(2);
        assert_eq!(p.take(), Some(0));
        assert_eq!(p.take(), Some(1));
        assert_eq!(p.take(), None);
        p.put(0);
        assert_eq!(p.take(), Some(0));
        assert_eq!(p.take(), None);
    }
}
