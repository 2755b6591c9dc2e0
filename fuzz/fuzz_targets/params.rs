//! Backend-parameter parser: arbitrary key/value lists (as NIXL passes them from create_backend).
//! Oracles: never panics; a successful parse stays inside the documented ranges; a refusal
//! names a declared parameter; keys the manifest does not declare are ignored, never refused.
#![no_main]

use io_uring_dmabuf::ffi::manifest;
use io_uring_dmabuf::params::EngineParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Input: lines "key=value"; a leading byte < 0x20 picks a declared key by index so that the
    // fuzzer reaches every parameter's value parser quickly.
    let text = String::from_utf8_lossy(data);
    let mut owned: Vec<(String, String)> = Vec::new();
    for line in text.split('\n') {
        let (k, v) = line.split_once('=').unwrap_or((line, ""));
        let key = match k.as_bytes().first() {
            Some(&b) if b < 0x20 && !manifest::PARAMS.is_empty() => manifest::PARAMS
                [b as usize % manifest::PARAMS.len()]
            .name
            .to_owned(),
            _ => k.to_owned(),
        };
        owned.push((key, v.to_owned()));
    }
    let pairs = owned.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    match EngineParams::parse(pairs) {
        Ok((p, ignored)) => {
            assert!(
                (16..=32768).contains(&p.ring_entries),
                "ring_entries {}",
                p.ring_entries
            );
            assert!(p.max_io_size == 0 || p.max_io_size >= 4096);
            assert!(p.staging_buffer_size >= 65536 && p.staging_buffer_size % 4096 == 0);
            assert!((2..=256).contains(&p.staging_buffers));
            for k in &ignored {
                assert!(
                    manifest::PARAMS.iter().all(|d| d.name != k),
                    "declared key {k} ignored"
                );
            }
        }
        Err(e) => {
            assert!(
                manifest::PARAMS.iter().any(|d| e.message.contains(d.name)),
                "refusal names no parameter: {}",
                e.message
            );
        }
    }
});
