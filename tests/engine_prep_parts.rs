//! prepXfer of a large list planned in parts by several threads (`prep_threads`): the bytes land
//! where the descriptors say, as when the list is planned whole, and a bad descriptor fails the
//! request with the message it gets planned whole. Each engine's partner in these tests plans
//! alone (`prep_threads=1`), and the file is also read back without the plugin.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use io_uring_dmabuf::engine::Engine;
use io_uring_dmabuf::ffi::bridge::iud_desc;

mod common;
use common::*;

const BLOCK: u64 = 4096;

fn engine(prep_threads: &str) -> Engine {
    Engine::new(AGENT, [("prep_threads", prep_threads)]).expect("engine")
}

struct Scene {
    _dir: TestDir,
    file: std::fs::File,
    /// Two memory regions of `n` blocks each: descriptors alternate between them in runs.
    mem: [Buf; 2],
    n: u64,
}

impl Scene {
    fn new(tag: &str, n: u64, seed: u64) -> Scene {
        let dir = TestDir::new(&format!("prep-parts-{tag}"));
        let file = lone_file(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(dir.path.join("kv"))
                .unwrap(),
        );
        file.set_len(2 * n * BLOCK).unwrap();
        Scene {
            _dir: dir,
            file,
            mem: [
                Buf::new((n * BLOCK) as usize, seed),
                Buf::new((n * BLOCK) as usize, seed + 1),
            ],
            n,
        }
    }

    /// Where descriptor j's block is: (memory region, block in it, file block). The first third
    /// runs on in memory and file (neighbours merge, also across part boundaries), the rest is
    /// scattered over both regions and twice the file's blocks.
    fn place(&self, j: u64) -> (usize, u64, u64) {
        let n = self.n;
        if j < n / 3 {
            (0, j, j)
        } else {
            ((j / 7 % 2) as usize, (j * 7919) % n, n + (j * 104_729) % n)
        }
    }

    /// The lists for descriptors `0..n` of engine `e` (regions and file registered with it).
    fn lists(&self, e: &Engine) -> (Vec<iud_desc>, Vec<iud_desc>) {
        let fd = self.file.as_raw_fd() as u64;
        let mds = [0, 1].map(|r| {
            e.register(DRAM, self.mem[r].addr(), self.n * BLOCK, 0, "")
                .expect("register memory")
        });
        let mf = e
            .register(FILE, 0, 2 * self.n * BLOCK, fd, "")
            .expect("register file");
        (0..self.n)
            .map(|j| {
                let (r, m, f) = self.place(j);
                (
                    desc(self.mem[r].addr() + m * BLOCK, BLOCK, 0, mds[r]),
                    desc(f * BLOCK, BLOCK, fd, mf),
                )
            })
            .unzip()
    }

    /// Descriptor j's memory block, as it is now.
    fn block(&self, j: u64) -> Vec<u8> {
        let (r, m, _) = self.place(j);
        self.mem[r].bytes()[(m * BLOCK) as usize..((m + 1) * BLOCK) as usize].to_vec()
    }
}

/// Distinct memory blocks only: a scattered descriptor may name a block an earlier one names.
fn unique_descriptors(s: &Scene) -> Vec<u64> {
    let mut seen = std::collections::HashSet::new();
    let mut file_seen = std::collections::HashSet::new();
    (0..s.n)
        .filter(|&j| {
            let (r, m, f) = s.place(j);
            seen.insert((r, m)) & file_seen.insert(f)
        })
        .collect()
}

#[test]
fn lists_planned_in_parts_move_the_bytes_planned_whole_would() {
    // 2049: two parts of unequal size; 5000: four unequal parts; 8192: four of 2048.
    for (k, n) in [2049u64, 5000, 8192].into_iter().enumerate() {
        let mut s = Scene::new(&format!("bytes{k}"), n, 11 + k as u64);
        let (parts, whole) = (engine("4"), engine("1"));
        let (pl, pr) = s.lists(&parts);
        let (wl, wr) = s.lists(&whole);
        let keep = unique_descriptors(&s);
        assert!(
            keep.len() as u64 > n / 2,
            "the layout names enough distinct blocks"
        );
        // Only the descriptors that name distinct memory and file blocks, so that every byte's
        // origin is one descriptor.
        let pick = |l: &[iud_desc], r: &[iud_desc]| -> (Vec<iud_desc>, Vec<iud_desc>) {
            keep.iter().map(|&j| (l[j as usize], r[j as usize])).unzip()
        };
        let (pl, pr) = pick(&pl, &pr);
        let (wl, wr) = pick(&wl, &wr);

        // WRITE planned in parts; the file read back without the plugin.
        let written: Vec<Vec<u8>> = keep.iter().map(|&j| s.block(j)).collect();
        run_kind(&parts, WRITE, FILE, &pl, &pr)
            .unwrap_or_else(|e| panic!("n={n}: WRITE in parts: {}", e.message));
        for (i, &j) in keep.iter().enumerate() {
            let mut got = vec![0u8; BLOCK as usize];
            s.file
                .read_exact_at(&mut got, s.place(j).2 * BLOCK)
                .unwrap();
            assert!(
                got == written[i],
                "n={n}: descriptor {j}'s block is not where its remote descriptor says"
            );
        }
        // READ planned whole brings the same bytes back (the regions cleared first).
        for m in &mut s.mem {
            m.bytes_mut().fill(0);
        }
        run_kind(&whole, READ, FILE, &wl, &wr)
            .unwrap_or_else(|e| panic!("n={n}: READ whole: {}", e.message));
        for (i, &j) in keep.iter().enumerate() {
            assert!(
                s.block(j) == written[i],
                "n={n}: descriptor {j} read back other bytes"
            );
        }
        // READ planned in parts into cleared memory, after the file changed under a WRITE planned whole.
        for m in &mut s.mem {
            for (i, b) in m.bytes_mut().iter_mut().enumerate() {
                *b = (i as u8) ^ 0x5a;
            }
        }
        let rewritten: Vec<Vec<u8>> = keep.iter().map(|&j| s.block(j)).collect();
        run_kind(&whole, WRITE, FILE, &wl, &wr)
            .unwrap_or_else(|e| panic!("n={n}: WRITE whole: {}", e.message));
        for m in &mut s.mem {
            m.bytes_mut().fill(0);
        }
        run_kind(&parts, READ, FILE, &pl, &pr)
            .unwrap_or_else(|e| panic!("n={n}: READ in parts: {}", e.message));
        for (i, &j) in keep.iter().enumerate() {
            assert!(
                s.block(j) == rewritten[i],
                "n={n}: descriptor {j} read in parts brought other bytes"
            );
        }
    }
}

#[test]
fn the_first_bad_descriptor_fails_the_request_as_planned_whole() {
    let n = 8192u64;
    let s = Scene::new("bad", n, 3);
    let (parts, whole) = (engine("4"), engine("1"));
    let (pl, pr) = s.lists(&parts);
    let (wl, wr) = s.lists(&whole);
    // Bad descriptors in part 0 only, in a later part only, and in two later parts (the
    // earlier one is reported); each kind of fault: a length mismatch, memory outside every
    // registration, a file range past the registration.
    let cases: [&[(usize, u8)]; 4] = [
        &[(100, 0)],
        &[(5000, 1)],
        &[(7000, 2), (2500, 1)],
        &[(8191, 0), (6200, 2)],
    ];
    for faults in cases {
        let spoil = |l: &[iud_desc], r: &[iud_desc]| {
            let (mut l, mut r) = (l.to_vec(), r.to_vec());
            for &(i, how) in faults {
                match how {
                    0 => r[i].len = 2 * BLOCK,
                    1 => l[i].addr = 0x1000,
                    _ => r[i].addr = 4 * n * BLOCK,
                }
            }
            (l, r)
        };
        let (a, b) = spoil(&pl, &pr);
        let (c, d) = spoil(&wl, &wr);
        let in_parts = parts
            .prep(WRITE, DRAM, &a, FILE, &b, AGENT)
            .expect_err("a bad list is refused in parts");
        let alone = whole
            .prep(WRITE, DRAM, &c, FILE, &d, AGENT)
            .expect_err("a bad list is refused whole");
        let first = faults.iter().map(|f| f.0).min().unwrap();
        assert!(
            in_parts.message.contains(&format!("descriptor {first}")),
            "{faults:?}: {}",
            in_parts.message
        );
        // The messages name the same descriptor and fault; MDs differ between the engines.
        let strip = |m: &str| m.split(" (its MD").next().unwrap().to_owned();
        assert_eq!(in_parts.kind, alone.kind, "{faults:?}");
        assert_eq!(
            strip(&in_parts.message),
            strip(&alone.message),
            "{faults:?}"
        );
    }
    // The engine still plans good lists in parts after refusals.
    run_kind(&parts, WRITE, FILE, &pl, &pr)
        .unwrap_or_else(|e| panic!("good list after refusals: {}", e.message));
}

#[test]
fn threads_preparing_at_once_share_the_helpers_and_each_request_is_right() {
    // Four client threads on one engine, each its own scene: a prepXfer that finds the helpers
    // busy plans alone; every request moves its own bytes.
    let e = engine("4");
    let scenes: Vec<Scene> = (0..4)
        .map(|t| Scene::new(&format!("threads{t}"), 4096, 40 + t))
        .collect();
    std::thread::scope(|sc| {
        for s in &scenes {
            let e = &e;
            sc.spawn(move || {
                let (l, r) = s.lists(e);
                let keep = unique_descriptors(s);
                let (l, r): (Vec<iud_desc>, Vec<iud_desc>) =
                    keep.iter().map(|&j| (l[j as usize], r[j as usize])).unzip();
                for round in 0..5 {
                    run_kind(e, WRITE, FILE, &l, &r)
                        .unwrap_or_else(|err| panic!("round {round}: {}", err.message));
                    for &j in keep.iter().step_by(97) {
                        let mut got = vec![0u8; BLOCK as usize];
                        s.file
                            .read_exact_at(&mut got, s.place(j).2 * BLOCK)
                            .unwrap();
                        assert!(got == s.block(j), "round {round}: descriptor {j}");
                    }
                }
            });
        }
    });
}
