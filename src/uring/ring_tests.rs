//! The ring's behaviour once its core lock is poisoned: the engine fails, and the teardown path
//! (slots released from `Drop`s) still goes through.

use std::sync::Arc;

use super::workers::{WorkerConfig, WriterLimits};
use super::Ring;
use crate::error::{status, Failure};
use crate::test_support::skip;

#[test]
fn a_poisoned_ring_lock_fails_the_engine_and_slots_are_still_released() {
    let failure = Arc::new(Failure::default());
    let ring = match Ring::new(
        8,
        true,
        WorkerConfig {
            threads: 2,
            writers: WriterLimits::default(),
            spin_us: 0,
        },
        Arc::clone(&failure),
    ) {
        Ok(r) => r,
        Err(e) => return skip(&e.message),
    };
    let mut page = vec![0u8; 4096];
    // SAFETY: the page outlives the slot, which is released below.
    let slot = unsafe { ring.register_buffer(page.as_mut_ptr() as u64, 4096) };
    ring.poison_core();
    let e = ring.lock().err().expect("a poisoned ring lock is an error");
    assert_eq!(e.to_status(), status::ERR_BACKEND);
    assert!(
        e.message
            .contains("internal lock io_uring ring is poisoned"),
        "{}",
        e.message
    );
    let e = failure.check().unwrap_err();
    assert!(e.message.contains("io_uring ring"), "{}", e.message);
    // Teardown cannot answer an error: releasing recovers the lock instead of panicking.
    if let Ok(slot) = slot {
        ring.release_buffer(slot);
    }
    // SAFETY: as above (refused: nothing is registered).
    assert!(unsafe { ring.register_buffer(page.as_mut_ptr() as u64, 4096) }.is_err());
}
