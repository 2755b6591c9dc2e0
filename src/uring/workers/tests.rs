//! Tests of the page-cache workers: results and counts, a poisoned queue, batching, the writer limit, callers helping.

use super::*;
use std::io::Write;
use std::os::fd::AsRawFd;

#[test]
fn reads_and_writes_land_and_report_their_counts() {
    let mut f = tempfile_in_tmp();
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    f.write_all(&data).unwrap();
    let w = PageCacheWorkers::new(
        WorkerConfig {
            threads: 3,
            writers: WriterLimits::default(),
            spin_us: 0,
        },
        Arc::default(),
    )
    .unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 128 << 10]).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        w.submit(Job {
            token: i as u64,
            fd: f.as_raw_fd(),
            offset: (i as u64) << 17,
            addr: b.as_mut_ptr() as u64,
            len: 128 << 10,
            write: false,
        });
    }
    // A read past the end returns 0; a bad fd returns -EBADF.
    let mut tail = vec![0u8; 4096];
    w.submit(Job {
        token: 100,
        fd: f.as_raw_fd(),
        offset: 2 << 20,
        addr: tail.as_mut_ptr() as u64,
        len: 4096,
        write: false,
    });
    w.submit(Job {
        token: 101,
        fd: -1,
        offset: 0,
        addr: tail.as_mut_ptr() as u64,
        len: 4096,
        write: false,
    });
    let mut done = Vec::new();
    while done.len() < 10 {
        w.wait_done(Duration::from_millis(100));
        w.take_done(&mut done);
    }
    done.sort();
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(done[i], (i as u64, 128 << 10));
        assert_eq!(&b[..], &data[i << 17..(i + 1) << 17]);
    }
    assert_eq!(done[8], (100, 0));
    assert_eq!(done[9], (101, -libc::EBADF));
    let patch = vec![0xa5u8; 4096];
    w.submit(Job {
        token: 7,
        fd: f.as_raw_fd(),
        offset: 8192,
        addr: patch.as_ptr() as u64,
        len: 4096,
        write: true,
    });
    let mut done = Vec::new();
    while done.is_empty() {
        w.wait_done(Duration::from_millis(100));
        w.take_done(&mut done);
    }
    assert_eq!(done, vec![(7, 4096)]);
    let mut back = vec![0u8; 4096];
    // SAFETY: reads into a live local buffer.
    let n = unsafe { libc::pread(f.as_raw_fd(), back.as_mut_ptr().cast(), 4096, 8192) };
    assert_eq!(n, 4096);
    assert_eq!(back, patch);
}

#[test]
fn a_poisoned_queue_fails_the_engine_and_results_still_arrive() {
    let failure = Arc::new(Failure::default());
    let w = PageCacheWorkers::new(
        WorkerConfig {
            threads: 1,
            writers: WriterLimits::default(),
            spin_us: 0,
        },
        Arc::clone(&failure),
    )
    .unwrap();
    crate::error::poison(&w.shared.queues);
    let f = tempfile_in_tmp();
    let mut buf = vec![0u8; 4096];
    w.submit(Job {
        token: 9,
        fd: f.as_raw_fd(),
        offset: 0,
        addr: buf.as_mut_ptr() as u64,
        len: 4096,
        write: false,
    });
    let mut done = Vec::new();
    while done.is_empty() {
        w.wait_done(Duration::from_millis(100));
        w.take_done(&mut done);
    }
    assert_eq!(done, vec![(9, 0)]);
    let e = failure.check().unwrap_err();
    assert!(
        e.message.contains("page-cache workers' queue is poisoned"),
        "{}",
        e.message
    );
}

fn idle_queue(writers: WriterLimits) -> Arc<Shared> {
    Arc::new(Shared::new(1, writers, 0, Arc::default()))
}

fn job(token: u64, fd: i32, write: bool) -> Job {
    Job {
        token,
        fd,
        offset: 0,
        addr: 0,
        len: 0,
        write,
    }
}

#[test]
fn the_caller_runs_queued_reads_and_leaves_writes_to_the_workers() {
    let mut f = tempfile_in_tmp();
    let data: Vec<u8> = (0..(256u32 << 10))
        .map(|i| (i.wrapping_mul(40503) >> 7) as u8)
        .collect();
    f.write_all(&data).unwrap();
    // No worker thread: only the caller can run anything here.
    let shared = idle_queue(WriterLimits::default());
    let helper = QueueHelper {
        shared: Arc::clone(&shared),
    };
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 64 << 10]).collect();
    let reads: Vec<Job> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| Job {
            token: i as u64,
            fd: f.as_raw_fd(),
            offset: (i as u64) << 16,
            addr: b.as_mut_ptr() as u64,
            len: 64 << 10,
            write: false,
        })
        .collect();
    let patch = [7u8; 4096];
    let write = Job {
        token: 9,
        fd: f.as_raw_fd(),
        offset: 0,
        addr: patch.as_ptr() as u64,
        len: 4096,
        write: true,
    };
    {
        let mut q = shared.queues.lock().unwrap();
        q.jobs.push_back(reads[..2].to_vec());
        q.jobs.push_back(reads[2..].to_vec());
        q.jobs.push_back(vec![write]);
    }
    assert_eq!(helper.run_queued_reads(), 4);
    let mut done = std::mem::take(&mut shared.queues.lock().unwrap().done);
    done.sort();
    assert_eq!(done, (0..4).map(|i| (i, 64 << 10)).collect::<Vec<_>>());
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(&b[..], &data[i << 16..(i + 1) << 16]);
    }
    // The write stays queued for a worker, and the file is unchanged.
    assert_eq!(shared.queues.lock().unwrap().jobs.len(), 1);
    assert_eq!(helper.run_queued_reads(), 0);
}

#[test]
fn a_batch_takes_only_jobs_of_its_fd_and_direction() {
    let batch = vec![job(1, 5, false), job(2, 5, false)];
    assert!(joins_batch(&[], &job(0, 7, true)));
    assert!(joins_batch(&batch, &job(3, 5, false)));
    assert!(
        !joins_batch(&batch, &job(3, 6, false)),
        "another fd starts a new batch"
    );
    assert!(
        !joins_batch(&batch, &job(3, 5, true)),
        "a write does not join reads"
    );
}

#[test]
fn a_file_gets_at_most_its_writers_while_reads_and_other_files_go_on() {
    let mut q = Queues::new(4);
    q.jobs.push_back(vec![job(1, 5, true)]);
    q.jobs.push_back(vec![job(2, 5, true)]);
    q.jobs.push_back(vec![job(3, 6, true)]);
    q.jobs.push_back(vec![job(4, 5, false)]);
    let one = WriterLimits { file: 1, all: 0 };
    let first = q.take_runnable(one, 0).unwrap();
    assert_eq!(first[0].token, 1);
    // fd 5 has its one writer: the next write to it waits, fd 6 and the read do not.
    assert_eq!(q.take_runnable(one, 1).unwrap()[0].token, 3);
    assert_eq!(q.take_runnable(one, 2).unwrap()[0].token, 4);
    assert!(q.take_runnable(one, 3).is_none());
    q.batch_ended(&first, 0);
    assert_eq!(q.take_runnable(one, 0).unwrap()[0].token, 2);
    // Without a limit, writes run in queue order regardless of the fd.
    let mut q = Queues::new(4);
    q.jobs.push_back(vec![job(1, 5, true)]);
    q.jobs.push_back(vec![job(2, 5, true)]);
    assert_eq!(
        q.take_runnable(WriterLimits::default(), 1).unwrap()[0].token,
        1
    );
    assert_eq!(
        q.take_runnable(WriterLimits::default(), 2).unwrap()[0].token,
        2
    );
}

#[test]
fn writes_to_all_files_together_stay_within_their_limit_while_reads_go_on() {
    let mut q = Queues::new(4);
    for (token, fd) in [(1, 5), (2, 6), (3, 7)] {
        q.jobs.push_back(vec![job(token, fd, true)]);
    }
    q.jobs.push_back(vec![job(4, 8, false)]);
    let two = WriterLimits { file: 0, all: 2 };
    let first = q.take_runnable(two, 0).unwrap();
    assert_eq!(q.take_runnable(two, 1).unwrap()[0].token, 2);
    // Two writes run: the third waits although its file has no writer; the read does not.
    assert_eq!(q.take_runnable(two, 2).unwrap()[0].token, 4);
    assert!(q.take_runnable(two, 3).is_none());
    q.batch_ended(&first, 0);
    assert_eq!(q.take_runnable(two, 0).unwrap()[0].token, 3);
    assert_eq!(q.writing_all, 2);
}

#[test]
fn the_worker_whose_write_ended_takes_the_held_back_write_and_wakes_no_one() {
    let one = WriterLimits { file: 1, all: 0 };
    let mut q = Queues {
        sleeping: 3,
        ..Queues::new(4)
    };
    for token in 1..=3 {
        q.jobs.push_back(vec![job(token, 5, true)]);
    }
    let first = q.take_runnable(one, 0).unwrap();
    let (next, wake) = q.end_and_take(&first, 0, one);
    assert_eq!(next.unwrap()[0].token, 2, "the same worker writes on");
    assert!(!wake, "nothing else may run: the sleepers stay asleep");
    assert_eq!(
        (q.waking, q.writing_all, q.running[0].clone()),
        (0, 1, vec![2])
    );
    // A read queued ahead is taken first; the write the freed place admits goes to one sleeper.
    let mut q = Queues {
        sleeping: 3,
        ..Queues::new(4)
    };
    q.jobs.push_back(vec![job(1, 5, true)]);
    let first = q.take_runnable(one, 0).unwrap();
    q.jobs.push_back(vec![job(2, 6, false)]);
    q.jobs.push_back(vec![job(3, 5, true)]);
    let (next, wake) = q.end_and_take(&first, 0, one);
    assert_eq!(next.unwrap()[0].token, 2);
    assert!(
        wake && q.waking == 1,
        "one sleeper is woken for the write, not all three"
    );
    // A read's end frees no writer's place: no wake-up, whatever is queued.
    let read = vec![job(4, 6, false)];
    q.running[1] = vec![4];
    let (next, wake) = q.end_and_take(&read, 1, one);
    assert_eq!(next.unwrap()[0].token, 3);
    assert!(!wake);
}

#[test]
fn a_job_wakes_only_a_sleeping_worker_that_no_notify_has_reached() {
    let mut q = Queues {
        sleeping: 2,
        ..Queues::default()
    };
    assert!(q.wake_one());
    assert!(q.wake_one());
    assert!(
        !q.wake_one(),
        "both sleepers are being woken: the third job waits for a free worker"
    );
    let mut q = Queues::default();
    assert!(!q.wake_one(), "every worker busy: no wake-up");
    q.sleeping = 3;
    q.waking = 1;
    q.wake_all();
    assert_eq!(q.waking, 3);
}

#[test]
fn bursts_to_sleeping_workers_all_run() {
    // Workers fall asleep between bursts of 1-9 batches (fewer and more than the workers), and
    // every job of every burst must come back: a wake-up skipped wrongly would strand one.
    let mut f = tempfile_in_tmp();
    f.write_all(&vec![3u8; 64 << 10]).unwrap();
    // Declared before the workers, so that it outlives them (they join on drop, a failed
    // assertion included, after running what is still queued).
    let mut buf = vec![0u8; 4096];
    let w = PageCacheWorkers::new(
        WorkerConfig {
            threads: 4,
            writers: WriterLimits { file: 1, all: 2 },
            spin_us: 0,
        },
        Arc::default(),
    )
    .unwrap();
    let mut token = 0u64;
    for burst in 0..300u64 {
        let batches = 1 + burst % 9;
        let mut want = 0;
        for b in 0..batches {
            // Reads, and every third batch a write (held back by the writer limits at times).
            let write = b % 3 == 2;
            let jobs: Vec<Job> = (0..1 + b % 3)
                .map(|k| {
                    token += 1;
                    Job {
                        token,
                        fd: f.as_raw_fd(),
                        offset: (k * 4096) % (64 << 10),
                        addr: buf.as_mut_ptr() as u64,
                        len: 512,
                        write,
                    }
                })
                .collect();
            want += jobs.len();
            w.submit_batch(jobs);
        }
        let mut done = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while done.len() < want {
            assert!(
                std::time::Instant::now() < deadline,
                "burst {burst}: {} of {want} jobs came back",
                done.len()
            );
            w.wait_done(Duration::from_millis(50));
            w.take_done(&mut done);
        }
        assert!(
            done.iter().all(|&(_, n)| n == 512),
            "burst {burst}: {done:?}"
        );
        if burst % 50 == 0 {
            // Let every worker fall asleep.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn tempfile_in_tmp() -> std::fs::File {
    let path = std::env::temp_dir().join(format!(
        "iud-workers-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let _ = std::fs::remove_file(&path);
    f
}

#[test]
fn spinning_workers_take_jobs_while_watching_and_after_they_slept() {
    let mut f = tempfile_in_tmp();
    let data: Vec<u8> = (0..(64u32 << 10))
        .map(|i| (i * 7 + i / 251) as u8)
        .collect();
    f.write_all(&data).unwrap();
    // 2 ms of watching: the first jobs arrive while the workers watch (no wake-up), the last
    // after they slept (a wake-up), and every one lands whole.
    let w = PageCacheWorkers::new(
        WorkerConfig {
            threads: 2,
            writers: WriterLimits::default(),
            spin_us: 2000,
        },
        Arc::default(),
    )
    .unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; 16 << 10]).collect();
    for (i, b) in bufs.iter_mut().enumerate() {
        std::thread::sleep(Duration::from_micros(if i == 5 { 20_000 } else { 300 }));
        w.submit(Job {
            token: i as u64,
            fd: f.as_raw_fd(),
            offset: (i as u64 % 4) << 14,
            addr: b.as_mut_ptr() as u64,
            len: 16 << 10,
            write: false,
        });
        let mut done = Vec::new();
        let t0 = std::time::Instant::now();
        while done.is_empty() {
            assert!(t0.elapsed() < Duration::from_secs(10), "job {i} never ran");
            w.wait_done(Duration::from_millis(100));
            w.take_done(&mut done);
        }
        assert_eq!(done, vec![(i as u64, 16 << 10)]);
        assert_eq!(&b[..], &data[(i % 4) << 14..((i % 4) + 1) << 14], "job {i}");
    }
}
