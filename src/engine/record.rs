//! Recording mode: every registration, prepared request and post as one JSON line, so a user can
//! capture an application's real I/O pattern and replay it (bench/replay.py).
//!
//! Enabled by the `record` backend parameter or the `IO_URING_DMABUF_RECORD` environment variable
//! (a file path; lines are appended). Off by default; nothing on the data path pays for it then.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::ffi::bridge::iud_desc;
use crate::mem::MemKind;

/// Appends JSON lines to a file.
pub struct Recorder {
    out: Mutex<BufWriter<File>>,
}

fn kind_name(kind: i32) -> &'static str {
    MemKind::from_nixl(kind).map_or("UNKNOWN", |k| k.name())
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn descs_json(descs: &[iud_desc]) -> String {
    let mut o = String::with_capacity(descs.len() * 24 + 2);
    o.push('[');
    for (i, d) in descs.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        let _ = write!(o, "[{},{},{}]", d.addr, d.len, d.dev_id);
    }
    o.push(']');
    o
}

impl Recorder {
    /// Opens `path` for appending.
    pub fn open(path: &str) -> Result<Recorder> {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::os(format!("record: cannot open {path:?} for appending"), &e))?;
        tracing::info!("recording registrations and transfers to {path}");
        Ok(Recorder {
            out: Mutex::new(BufWriter::new(f)),
        })
    }

    fn line(&self, body: String) {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        // A failing record file must not fail transfers; it is reported once per write error.
        if let Err(e) = writeln!(out, "{{\"t_us\":{t},{body}}}").and_then(|_| out.flush()) {
            tracing::warn!("record: write failed: {e}");
        }
    }

    pub fn register(&self, md: usize, kind: i32, addr: u64, len: u64, dev_id: u64, meta: &str) {
        self.line(format!(
            "\"event\":\"register\",\"md\":{md},\"kind\":\"{}\",\"addr\":{addr},\
             \"len\":{len},\"dev_id\":{dev_id},\"meta\":{}",
            kind_name(kind),
            json_str(meta)
        ));
    }

    pub fn deregister(&self, md: usize) {
        self.line(format!("\"event\":\"deregister\",\"md\":{md}"));
    }

    /// A prepared request: both lists in full, each as (NIXL memory kind, descriptors), and
    /// how many I/Os they became after splitting and merging.
    pub fn prep(
        &self,
        req: usize,
        op: i32,
        (local_kind, local): (i32, &[iud_desc]),
        (remote_kind, remote): (i32, &[iud_desc]),
        ios: usize,
        bytes: u64,
    ) {
        self.line(format!(
            "\"event\":\"prep\",\"req\":{req},\"op\":\"{}\",\"local_kind\":\"{}\",\
             \"remote_kind\":\"{}\",\"count\":{},\"bytes\":{bytes},\"ios_after_merge\":{ios},\
             \"local\":{},\"remote\":{}",
            if op == 1 { "WRITE" } else { "READ" },
            kind_name(local_kind),
            kind_name(remote_kind),
            local.len(),
            descs_json(local),
            descs_json(remote)
        ));
    }

    pub fn post(&self, req: usize, status: &str) {
        self.line(format!(
            "\"event\":\"post\",\"req\":{req},\"status\":{}",
            json_str(status)
        ));
    }

    pub fn release(&self, req: usize) {
        self.line(format!("\"event\":\"release\",\"req\":{req}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_for_json() {
        assert_eq!(json_str("rw:/a\"b\\c\n"), "\"rw:/a\\\"b\\\\c\\u000a\"");
    }

    #[test]
    fn descriptor_lists_are_arrays_of_triples() {
        let d = [
            iud_desc {
                addr: 1,
                len: 2,
                dev_id: 3,
                md: std::ptr::null(),
            },
            iud_desc {
                addr: 4,
                len: 5,
                dev_id: 6,
                md: std::ptr::null(),
            },
        ];
        assert_eq!(descs_json(&d), "[[1,2,3],[4,5,6]]");
    }
}
