//! One run of descriptor pairs, validated and cut into ring ops: prepXfer's work per descriptor
//! (`plan.rs` runs it over a whole list, or over parts of a large one at once).
//!
//! Every rule the kernel would otherwise enforce with a bare EINVAL is checked with a message
//! that names the descriptor: equal lengths, coverage by a registration of this engine and the
//! file's access mode here, O_DIRECT alignment in `cut.rs`, which also splits descriptors at
//! `max_io_size` and at fixed-buffer slot boundaries and merges neighbours that continue each
//! other in memory and file up to the same size.

use std::collections::HashMap;
use std::sync::Arc;

use super::bind::Binder;
use super::cut::{Bound, Limits};
use super::direction::XferOp;
use super::recycle::OpLists;
use crate::error::{Error, ErrorKind, Result};
use crate::ffi::bridge::iud_desc;
use crate::mem::live::{Coverage, Registry, Unresolved};
use crate::mem::{MemKind, Registration};
use crate::path::Route;
use crate::uring::IoOp;

/// How many (MD, registration) hints each side keeps; lists name one or a few registrations per
/// side (KV caches: one per layer or region), and a short scan is cheaper than any lookup.
const HINTS: usize = 8;

/// The registrations of a request's descriptors, resolved through the engine's registry and
/// deduplicated (lists name one or a few registrations for thousands of descriptors).
struct Registrations<'a> {
    registry: &'a Registry,
    index: HashMap<usize, usize>,
    list: Vec<Arc<Registration>>,
    /// Per side (memory, storage): up to `HINTS` recent distinct MDs and the registration each
    /// last resolved to; a descriptor with one of them whose registration covers it needs no
    /// registry lookup (no lock, no hash), whatever order the regions come in.
    hints: [Vec<Hint>; 2],
    /// Per side: the hint a new MD replaces when all are taken (the oldest).
    victim: [usize; 2],
    /// Descriptors whose MD did not name a registration covering them (sync mode NONE).
    unhinted: usize,
}

/// An MD and the coverage of the registration it last resolved to, copied so that the check
/// per descriptor reads only this (the registration is immutable).
#[derive(Clone, Copy)]
struct Hint {
    md: usize,
    index: usize,
    coverage: Coverage,
}

impl Hint {
    /// `live::covers` of the hinted registration, for a descriptor carrying this MD.
    #[inline]
    fn covers(&self, kind: MemKind, d: &iud_desc) -> bool {
        self.md == d.md as usize && self.coverage.covers(kind, d)
    }
}

impl<'a> Registrations<'a> {
    fn new(registry: &'a Registry) -> Self {
        Registrations {
            registry,
            index: HashMap::new(),
            list: Vec::new(),
            hints: [Vec::new(), Vec::new()],
            victim: [0; 2],
            unhinted: 0,
        }
    }

    /// Index into `list` of the live registration of `kind` that covers `d`.
    #[inline]
    fn get(
        &mut self,
        side: usize,
        kind: MemKind,
        d: &iud_desc,
    ) -> std::result::Result<usize, Unresolved> {
        match self.hints[side].iter().find(|h| h.covers(kind, d)) {
            Some(h) => Ok(h.index),
            None => self.resolve(side, kind, d),
        }
    }

    /// `get` past the hints: the registry, then a hint for the MD.
    #[cold]
    fn resolve(
        &mut self,
        side: usize,
        kind: MemKind,
        d: &iud_desc,
    ) -> std::result::Result<usize, Unresolved> {
        let md = d.md as usize;
        let found = self.registry.resolve(kind, d)?;
        self.unhinted += usize::from(!found.by_hint);
        let list = &mut self.list;
        let i = *self
            .index
            .entry(Arc::as_ptr(&found.reg) as usize)
            .or_insert_with(|| {
                list.push(found.reg);
                list.len() - 1
            });
        // A new MD takes a free hint, else the oldest one's place: a list naming more than
        // `HINTS` MDs in runs (one region after another) still finds each run's MD here.
        let hint = Hint {
            md,
            index: i,
            coverage: Coverage::of(&self.list[i]),
        };
        let hints = &mut self.hints[side];
        if let Some(h) = hints.iter_mut().find(|h| h.md == md) {
            *h = hint;
        } else if hints.len() < HINTS {
            hints.push(hint);
        } else {
            hints[self.victim[side]] = hint;
            self.victim[side] = (self.victim[side] + 1) % HINTS;
        }
        Ok(i)
    }
}

/// The distinct (memory, storage) registration pairs of a request in order of first use;
/// descriptors refer to them by position. Consecutive descriptors mostly share a pair, and a
/// request has few: the last one and a short scan serve almost every descriptor, a map the rest
/// (a client with a file per key).
#[derive(Default)]
struct Pairs {
    list: Vec<(usize, usize)>,
    map: HashMap<(usize, usize), u32>,
    last: u32,
}

impl Pairs {
    const SCAN: usize = 16;

    /// The pair's position; a new pair takes the next one (`list.len()` before the call).
    fn index(&mut self, pair: (usize, usize)) -> u32 {
        if self.list.get(self.last as usize) == Some(&pair) {
            return self.last;
        }
        let found = if self.list.len() <= Self::SCAN {
            self.list.iter().position(|&p| p == pair).map(|k| k as u32)
        } else {
            self.map.get(&pair).copied()
        };
        let k = found.unwrap_or_else(|| {
            self.list.push(pair);
            let k = (self.list.len() - 1) as u32;
            if self.list.len() > Self::SCAN {
                if self.map.is_empty() {
                    self.map
                        .extend(self.list.iter().enumerate().map(|(j, &p)| (p, j as u32)));
                } else {
                    self.map.insert(pair, k);
                }
            }
            k
        });
        self.last = k;
        k
    }
}

/// The message for a descriptor that no live registration covers.
fn not_covered(i: usize, what: String, kind: MemKind, d: &iud_desc, why: Unresolved) -> Error {
    let mut m = format!(
        "descriptor {i}: {what} is not covered by any live {} registration of this engine",
        kind.name()
    );
    if let Some(other) = why.other_kind {
        m += &format!(
            " (a {} registration covers it: the list's memory type does not match)",
            other.name()
        );
    } else if !d.md.is_null() && !why.md_live {
        m += &format!(
            " (its MD {:p} was deregistered, or NIXL handed back a stale MD)",
            d.md
        );
    }
    Error::not_found(m)
}

/// What planning one run of descriptors found, beside its ops.
pub struct Part {
    pub ops: Vec<IoOp>,
    /// The registrations the run names, in order of first use.
    pub registrations: Vec<Arc<Registration>>,
    /// Descriptors whose MD did not name a registration covering them.
    pub unhinted: usize,
    /// Descriptors on the cuFile route.
    pub cufile_descs: usize,
    pub all_buffered: bool,
    pub all_host: bool,
    pub any_punt: bool,
    pub vram_outside_streams: bool,
}

impl Part {
    /// Appends the part that follows this one in the lists (its op list goes back to `lists`).
    pub fn append(&mut self, later: Part, lists: &OpLists) {
        self.ops.extend_from_slice(&later.ops);
        lists.give_back(later.ops);
        for reg in later.registrations {
            if !self.registrations.iter().any(|r| Arc::ptr_eq(r, &reg)) {
                self.registrations.push(reg);
            }
        }
        self.unhinted += later.unhinted;
        self.cufile_descs += later.cufile_descs;
        self.all_buffered &= later.all_buffered;
        self.all_host &= later.all_host;
        self.any_punt |= later.any_punt;
        self.vram_outside_streams |= later.vram_outside_streams;
    }
}

/// One request's lists as the planner cuts them: what every part of them is planned with.
pub struct ListPlanner<'a> {
    pub op: XferOp,
    /// (memory, storage) kinds of the lists.
    pub kinds: (MemKind, MemKind),
    pub registry: &'a Registry,
    /// Chooses (once per pair, cached in `path::routes`) how a memory registration reaches a
    /// target; called from every thread that plans a part of the request.
    pub binder: &'a Binder<'a>,
    pub limits: Limits,
}

impl ListPlanner<'_> {
    /// Validates `local[i]` / `remote[i]` pairs and cuts them into `ops` (an empty list); `first`
    /// is the index of `local[0]` in the request, for messages and `IoOp::desc_index`. Each
    /// descriptor is validated against its registrations, its (memory, target) pair bound to a path
    /// on first use (cached in `path::routes`: DMA-BUF registration and self-test, cuFile handles,
    /// the staging pool happen once per pair), its O_DIRECT alignment checked on that path's
    /// addresses, and it is cut into ops. A run refused at a later descriptor leaves only those
    /// per-pair bindings, which the next request of the same pair would make anyway. One pass over
    /// the lists: with the caches cold, as between a client's requests, reading them twice cost a
    /// fifth of the plan (tests/prep_profile.rs, IUD_PREP_SWEEP_MIB).
    pub fn part(
        &self,
        first: usize,
        local: &[iud_desc],
        remote: &[iud_desc],
        mut ops: Vec<IoOp>,
    ) -> Result<Part> {
        let (op, (lk, rk), limits) = (self.op, self.kinds, &self.limits);
        let mut regs = Registrations::new(self.registry);
        let mut distinct = Pairs::default();
        let mut routes: Vec<Route> = Vec::new();
        let mut cufile_descs = 0usize;
        let (mut all_buffered, mut all_host) = (true, true);
        let mut vram_outside_streams = false;
        for (j, (l, r)) in local.iter().zip(remote).enumerate() {
            let i = first + j;
            let pair = validate(i, op, lk, rk, l, r, &mut regs).map_err(|e| e.at_descriptor(i))?;
            let k = distinct.index(pair) as usize;
            let (m, f) = pair;
            let Registration::Storage(file) = &*regs.list[f] else {
                unreachable!("validated as storage")
            };
            if k == routes.len() {
                routes.push(
                    self.binder
                        .route(&regs.list[m], file)
                        .map_err(|e| e.at_descriptor(i).with_fd(file.fd))?,
                );
            }
            let (mem, route) = (&*regs.list[m], &routes[k]);
            cufile_descs += usize::from(*route == Route::Cufile);
            let bound = Bound {
                i,
                l,
                r,
                mem,
                file,
                route,
            };
            bound
                .check_alignment()
                .map_err(|e| e.at_descriptor(i).with_fd(file.fd).with_offset(r.addr))?;
            bound
                .cut(op, limits, &mut ops)
                .map_err(|e| e.at_descriptor(i))?;
            vram_outside_streams |=
                matches!(mem, Registration::Vram(_)) && *route != Route::Staging;
            all_buffered &= file.direct.is_none();
            // Inline pwrite needs real addresses: only memory addressed directly qualifies.
            all_host &= *route == Route::Host;
        }
        // Decided after merging, on the final sizes; punted ops run on the page-cache workers
        // (uring/workers.rs). Reads, and the writes of staged VRAM: their device copies overlap the
        // workers' writes, while DRAM writes are written by the calling threads (`inline_writes`).
        // Staged pieces of any size qualify: the small ones are packed several to a staging buffer
        // and reach the workers in groups (uring/ring/ gathers small punted ops into one job).
        // Host requests go only when `spreadable`.
        let mut any_punt = false;
        for o in &mut ops {
            let kind_ok = op == XferOp::Read || o.device.is_some();
            let big_enough = (o.len as u64 >= limits.punt_buffered_min && limits.spreadable)
                || o.device.is_some();
            o.punt &= kind_ok && limits.punt_buffered_min > 0 && big_enough;
            any_punt |= o.punt;
        }
        Ok(Part {
            ops,
            registrations: regs.list,
            unhinted: regs.unhinted,
            cufile_descs,
            all_buffered,
            all_host,
            any_punt,
            vram_outside_streams,
        })
    }
}

/// Checks one descriptor pair: equal non-zero lengths, live registrations of the lists' kinds
/// that cover it, the file's access mode. Returns (memory, storage) indices into `regs`.
fn validate(
    i: usize,
    op: XferOp,
    lk: MemKind,
    rk: MemKind,
    l: &iud_desc,
    r: &iud_desc,
    regs: &mut Registrations<'_>,
) -> Result<(usize, usize)> {
    if l.len != r.len {
        return Err(Error::new(
            ErrorKind::Mismatch,
            format!(
                "descriptor {i}: local length {} differs from remote length {}",
                l.len, r.len
            ),
        ));
    }
    if l.len == 0 {
        return Err(Error::invalid(format!("descriptor {i}: zero length")));
    }
    let mi = regs.get(0, lk, l).map_err(|why| {
        not_covered(
            i,
            format!(
                "local memory devId {} [0x{:x}, +{})",
                l.dev_id, l.addr, l.len
            ),
            lk,
            l,
            why,
        )
    })?;
    let fi = regs.get(1, rk, r).map_err(|why| {
        not_covered(
            i,
            format!("file range devId {} [{}, +{})", r.dev_id, r.addr, r.len),
            rk,
            r,
            why,
        )
    })?;
    let Registration::Storage(file) = &*regs.list[fi] else {
        unreachable!("resolved as {}", rk.name())
    };
    match op {
        XferOp::Write if !file.writable => {
            return Err(Error::invalid(format!(
                "descriptor {i}: WRITE to fd {} which is open read-only",
                file.fd
            ))
            .with_fd(file.fd))
        }
        XferOp::Read if !file.readable => {
            return Err(Error::invalid(format!(
                "descriptor {i}: READ from fd {} which is open write-only",
                file.fd
            ))
            .with_fd(file.fd))
        }
        _ => {}
    }
    Ok((mi, fi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_resolve_every_descriptor_to_its_region_with_more_regions_than_hints() {
        let workers = crate::uring::WorkerConfig {
            threads: 0,
            writers: crate::uring::WriterLimits::default(),
            spin_us: 0,
        };
        let ring =
            Arc::new(crate::uring::Ring::new(8, false, workers, Arc::default()).expect("ring"));
        let registry = Registry::default();
        // 12 regions (more than HINTS) of 64 KiB, 1 MiB apart.
        let mds: Vec<*const std::ffi::c_void> = (0..12u64)
            .map(|k| {
                // SAFETY: without fixed buffers the region only records the range; nothing touches it.
                let r = unsafe {
                    crate::mem::DramRegion::register(
                        Arc::clone(&ring),
                        0x100_0000 + (k << 20),
                        0x1_0000,
                        0,
                        false,
                    )
                };
                registry.insert(Registration::Dram(r))
            })
            .collect();
        let mut regs = Registrations::new(&registry);
        let desc = |k: u64, j: u64, md: *const std::ffi::c_void| iud_desc {
            addr: 0x100_0000 + (k << 20) + j * 0x1000,
            len: 0x1000,
            dev_id: 0,
            md: md as *mut _,
        };
        // Runs (region after region), then interleaved, then stale MDs (another region's).
        let order: Vec<(u64, u64)> = (0..12)
            .flat_map(|k| (0..4).map(move |j| (k, j)))
            .chain((0..48).map(|i| (i % 12, i % 16)))
            .collect();
        for (pass, &(k, j)) in order.iter().enumerate() {
            for md in [mds[k as usize], mds[(k as usize + 5) % 12]] {
                let i = regs
                    .get(0, MemKind::Dram, &desc(k, j, md))
                    .unwrap_or_else(|_| panic!("descriptor {pass} unresolved"));
                assert_eq!(
                    regs.list[i].range().0,
                    0x100_0000 + (k << 20),
                    "descriptor {pass} (region {k}) resolved elsewhere"
                );
            }
        }
        assert_eq!(regs.list.len(), 12);
        assert!(regs.hints[0].len() <= HINTS);
        // A range no region covers is refused, whatever the hints hold.
        assert!(regs.get(0, MemKind::Dram, &desc(3, 16, mds[3])).is_err());
    }

    #[test]
    fn pairs_keep_their_positions_past_the_scan() {
        let mut p = Pairs::default();
        // 40 distinct pairs in a scattered order, each seen again later: positions never move,
        // whether found by the last-hit check, the scan or (past 16 pairs) the map, and a new
        // pair takes the next position (the planner binds its route then).
        let order: Vec<usize> = (0..200).map(|i| (i * 7 + i / 13) % 40).collect();
        let mut seen: Vec<Option<u32>> = vec![None; 40];
        for &x in &order {
            let before = p.list.len();
            let k = p.index((x, 1000 + x));
            match seen[x] {
                Some(was) => assert_eq!(was, k, "pair {x} moved"),
                None => {
                    assert_eq!(k as usize, before, "a new pair takes the next position");
                    assert_eq!(p.list[k as usize], (x, 1000 + x), "first use of pair {x}");
                    seen[x] = Some(k);
                }
            }
        }
        assert_eq!(p.list.len(), 40);
        let mut ks: Vec<u32> = seen.iter().map(|k| k.unwrap()).collect();
        ks.sort_unstable();
        assert_eq!(ks, (0..40).collect::<Vec<u32>>());
    }
}
