//! The engine's own index of its live registrations. NIXL's MDs are opaque tokens the plugin
//! never dereferences: every descriptor is resolved here, by the token when it names a live
//! registration that covers the descriptor, else by what the descriptor itself says (memory
//! kind, devId and address range for DRAM/VRAM; devId and offset range for FILE/BLK).
//!
//! Why: with an agent in sync mode NONE (the Python default without a listen thread) NIXL's
//! registration lists are not locked (nixl src/core/sync.h), so threads that register,
//! deregister and prepare at once get MDs that are stale (already deregistered) or belong to
//! another registration (docs/reliability.md, "Sync mode NONE"). NIXL's POSIX backend survives this
//! because it acts on the descriptors, not the MDs; so does this index. Tokens are never
//! reused, so a stale one can never name a newer registration.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{MemKind, Registration};
use crate::ffi::bridge::iud_desc;

/// First token handed out; tokens grow by 16 so that they look like (and are as distinct as)
/// aligned pointers in NIXL's logs, and are never null.
const FIRST_TOKEN: usize = 0x1000;

/// Live registrations by token, and by what descriptors name.
#[derive(Debug, Default)]
pub struct Registry(Mutex<Index>);

#[derive(Debug, Default)]
struct Index {
    next: usize,
    by_token: HashMap<usize, Arc<Registration>>,
    /// DRAM and VRAM: (kind, devId, start, token) -> registration.
    memory: BTreeMap<(MemKind, u64, u64, usize), Arc<Registration>>,
    /// Longest memory registration per kind: a covering registration starts at most this far
    /// below a descriptor.
    longest: HashMap<MemKind, u64>,
    /// FILE and BLK: (kind, devId) -> the registrations with that devId, oldest first.
    storage: HashMap<(MemKind, u64), Vec<Live>>,
    /// DRAM and VRAM registrations that a newer live one overlaps. Their token is no longer
    /// taken at its word: NIXL's damaged lists (sync mode NONE) can keep handing out the MD of a
    /// registration whose memory was freed and mapped again at the same address, and its fixed
    /// buffers or DMA-BUF still name the old pages; the newest covering registration serves.
    superseded: HashSet<usize>,
}

/// A live registration and its token.
type Live = (usize, Arc<Registration>);

/// What decides whether a registration covers a descriptor: its kind, devId and range. A copy
/// of it can be held where reading the registration per descriptor costs (`xfer::plan`'s hints).
#[derive(Debug, Clone, Copy)]
pub struct Coverage {
    kind: MemKind,
    dev_id: u64,
    start: u64,
    end: u64,
}

impl Coverage {
    pub fn of(reg: &Registration) -> Self {
        let (start, end) = reg.range();
        Coverage {
            kind: reg.kind(),
            dev_id: reg.dev_id(),
            start,
            end,
        }
    }

    /// Whether the registration is of `kind` and covers the descriptor's devId and range.
    #[inline]
    pub fn covers(&self, kind: MemKind, d: &iud_desc) -> bool {
        self.kind == kind
            && self.dev_id == d.dev_id
            && d.addr >= self.start
            && d.addr.checked_add(d.len).is_some_and(|e| e <= self.end)
    }
}

/// Whether `reg` is of `kind` and covers the descriptor's devId and range.
pub fn covers(reg: &Registration, kind: MemKind, d: &iud_desc) -> bool {
    Coverage::of(reg).covers(kind, d)
}

impl Index {
    fn find(&self, kind: MemKind, d: &iud_desc) -> Option<&Arc<Registration>> {
        match kind {
            MemKind::Dram | MemKind::Vram => {
                let below = d.addr.saturating_sub(*self.longest.get(&kind)?);
                // The newest registration that covers the descriptor.
                self.memory
                    .range((kind, d.dev_id, below, 0)..=(kind, d.dev_id, d.addr, usize::MAX))
                    .filter(|(_, r)| covers(r, kind, d))
                    .max_by_key(|((.., token), _)| *token)
                    .map(|(_, r)| r)
            }
            _ => self
                .storage
                .get(&(kind, d.dev_id))?
                .iter()
                .rev()
                .map(|(_, r)| r)
                .find(|r| covers(r, kind, d)),
        }
    }
}

impl Registry {
    fn index(&self) -> MutexGuard<'_, Index> {
        // The index is consistent after every statement that mutates it, so a panic elsewhere
        // while it was held leaves nothing half-done.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a registration; returns the token handed to NIXL as its MD.
    pub fn insert(&self, reg: Registration) -> *const c_void {
        let reg = Arc::new(reg);
        let mut ix = self.index();
        ix.next = ix.next.max(FIRST_TOKEN) + 16;
        let token = ix.next;
        let kind = reg.kind();
        match kind {
            MemKind::Dram | MemKind::Vram => {
                let (start, end) = reg.range();
                let below = start.saturating_sub(ix.longest.get(&kind).copied().unwrap_or(0));
                let older: Vec<usize> = ix
                    .memory
                    .range((kind, reg.dev_id(), below, 0)..(kind, reg.dev_id(), end, 0))
                    .filter(|(_, r)| r.range().1 > start)
                    .map(|((.., t), _)| *t)
                    .collect();
                ix.superseded.extend(older);
                let longest = ix.longest.entry(kind).or_insert(0);
                *longest = (*longest).max(end - start);
                ix.memory
                    .insert((kind, reg.dev_id(), start, token), Arc::clone(&reg));
            }
            _ => ix
                .storage
                .entry((kind, reg.dev_id()))
                .or_default()
                .push((token, Arc::clone(&reg))),
        }
        ix.by_token.insert(token, reg);
        token as *const c_void
    }

    /// Takes the registration of `md` out of the index; None when `md` is not live (deregistered
    /// before, or never handed out by this engine). Prepared requests keep their own references.
    pub fn remove(&self, md: *const c_void) -> Option<Arc<Registration>> {
        let token = md as usize;
        let mut ix = self.index();
        let reg = ix.by_token.remove(&token)?;
        ix.superseded.remove(&token);
        let kind = reg.kind();
        match kind {
            MemKind::Dram | MemKind::Vram => {
                ix.memory
                    .remove(&(kind, reg.dev_id(), reg.range().0, token));
            }
            _ => {
                if let Some(list) = ix.storage.get_mut(&(kind, reg.dev_id())) {
                    list.retain(|(t, _)| *t != token);
                    if list.is_empty() {
                        ix.storage.remove(&(kind, reg.dev_id()));
                    }
                }
            }
        }
        Some(reg)
    }

    /// The live registration of `kind` that covers `d`: the one `d.md` names if it does, else
    /// any that does. `Err(stale)` when none does; `stale` says whether the MD was not live.
    pub fn resolve(&self, kind: MemKind, d: &iud_desc) -> Result<Resolved, Unresolved> {
        let ix = self.index();
        let token = d.md as usize;
        let hinted = ix.by_token.get(&token);
        if let Some(r) = hinted.filter(|r| covers(r, kind, d) && !ix.superseded.contains(&token)) {
            return Ok(Resolved {
                reg: Arc::clone(r),
                by_hint: true,
            });
        }
        if let Some(r) = ix.find(kind, d) {
            return Ok(Resolved {
                reg: Arc::clone(r),
                by_hint: false,
            });
        }
        let other_kind = [MemKind::Dram, MemKind::Vram, MemKind::File, MemKind::Blk]
            .into_iter()
            .find(|&k| k != kind && ix.find(k, d).is_some());
        Err(Unresolved {
            md_live: hinted.is_some(),
            other_kind,
        })
    }

    /// How many registrations are live (for tests and diagnostics).
    pub fn len(&self) -> usize {
        self.index().by_token.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A descriptor's registration.
pub struct Resolved {
    pub reg: Arc<Registration>,
    /// Found through the descriptor's MD (false: NIXL's MD was stale or foreign).
    pub by_hint: bool,
}

/// Why no live registration covers a descriptor.
#[derive(Debug)]
pub struct Unresolved {
    /// The descriptor's MD names a live registration (which does not cover it).
    pub md_live: bool,
    /// A live registration of another kind covers it (a list of the wrong kind).
    pub other_kind: Option<MemKind>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(addr: u64, len: u64, dev_id: u64, md: *const c_void) -> iud_desc {
        iud_desc {
            addr,
            len,
            dev_id,
            md: md as *mut c_void,
        }
    }

    fn dram(addr: u64, len: u64) -> Registration {
        let workers = crate::uring::WorkerConfig {
            threads: 0,
            writers: crate::uring::WriterLimits::default(),
            spin_us: 0,
        };
        let ring =
            Arc::new(crate::uring::Ring::new(8, false, workers, Arc::default()).expect("ring"));
        // SAFETY: without fixed buffers the region only records the range; nothing touches it.
        Registration::Dram(unsafe { crate::mem::DramRegion::register(ring, addr, len, 0, false) })
    }

    /// The registration a DRAM descriptor (devId 0) resolves to; the test fails if none covers it.
    fn dram_hit(r: &Registry, addr: u64, len: u64, md: *const c_void) -> Resolved {
        r.resolve(MemKind::Dram, &d(addr, len, 0, md))
            .expect("a live registration covers the descriptor")
    }

    /// Asserts that `asked` is served not through its own MD but by the registration `owner`
    /// (a descriptor carrying that registration's MD) resolves to.
    fn assert_served_by(
        r: &Registry,
        asked: (u64, u64, *const c_void),
        owner: (u64, u64, *const c_void),
    ) {
        let got = dram_hit(r, asked.0, asked.1, asked.2);
        assert!(!got.by_hint && Arc::ptr_eq(&got.reg, &dram_hit(r, owner.0, owner.1, owner.2).reg));
    }

    #[test]
    fn a_stale_or_foreign_md_resolves_by_address_and_tokens_are_never_reused() {
        let r = Registry::default();
        let a = r.insert(dram(0x10000, 0x1000));
        let b = r.insert(dram(0x20000, 0x4000));
        // b's token on a descriptor of a: found by address, not by the token.
        let got = dram_hit(&r, 0x10100, 0x100, b);
        assert!(!got.by_hint && got.reg.range() == (0x10000, 0x11000));
        assert!(dram_hit(&r, 0x20000, 0x4000, b).by_hint);
        assert!(r.remove(a).is_some() && r.remove(a).is_none());
        let c = r.insert(dram(0x10000, 0x1000));
        assert_ne!(a, c);
        // a is gone: a descriptor naming it finds c by address; a range nobody covers fails.
        assert!(!dram_hit(&r, 0x10000, 0x1000, a).by_hint);
        let miss = r
            .resolve(MemKind::Dram, &d(0x10f00, 0x200, 0, c))
            .err()
            .unwrap();
        assert!(miss.md_live && miss.other_kind.is_none());
        assert!(
            r.resolve(MemKind::Vram, &d(0x20000, 0x10, 0, b))
                .err()
                .unwrap()
                .other_kind
                == Some(MemKind::Dram)
        );
        assert!(
            r.resolve(MemKind::Dram, &d(0x20000, 0x10, 1, b)).is_err(),
            "devId must match"
        );
    }

    #[test]
    fn a_token_of_a_registration_a_newer_one_overlaps_is_not_taken_at_its_word() {
        // NIXL's lists (sync mode NONE) lost the deregistration of `old`; its memory was freed
        // and mapped again at the same address, and `new` registers it. NIXL may still hand
        // out `old`'s MD for the new buffer: `new` (the current pages) serves it.
        let r = Registry::default();
        let old = r.insert(dram(0x10000, 0x8000));
        let other = r.insert(dram(0x40000, 0x1000));
        let new = r.insert(dram(0x10000, 0x8000));
        assert_served_by(&r, (0x11000, 0x1000, old), (0x11000, 0x1000, new));
        assert!(dram_hit(&r, 0x11000, 0x1000, new).by_hint);
        // A newer registration starting lower and covering more wins over an older, closer one.
        let wider = r.insert(dram(0xf000, 0xa000));
        assert_served_by(&r, (0x11000, 0x1000, new), (0xf000, 0x10, wider));
        // Registrations nothing newer overlaps keep their fast path; removal forgets the mark.
        assert!(dram_hit(&r, 0x40000, 0x10, other).by_hint);
        assert!(r.remove(old).is_some() && r.remove(new).is_some());
        assert!(dram_hit(&r, 0x11000, 0x10, wider).by_hint);
    }

    #[test]
    fn the_newest_covering_registration_wins_and_long_ones_are_found() {
        let r = Registry::default();
        let long = r.insert(dram(0x1000, 1 << 30));
        let short = r.insert(dram(0x4000_0000, 0x1000));
        let hit = dram_hit(&r, 0x3000_0000, 0x10, short);
        assert_eq!(hit.reg.range().0, 0x1000);
        let newer = r.insert(dram(0x1000, 1 << 30));
        let hit = dram_hit(&r, 0x2000, 0x10, std::ptr::null());
        assert!(Arc::ptr_eq(
            &hit.reg,
            &dram_hit(&r, 0x2000, 0x10, newer).reg
        ));
        let _ = long;
        assert_eq!(r.len(), 3);
    }
}
