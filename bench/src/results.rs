//! --out_dir: the run's results as files: results.csv (one row per point and backend) and
//! results.md (the machine, the command and the tables), beside which ci/bench.sh puts the plot.

use std::path::Path;

use crate::cli::Op;
use crate::kv;
use crate::report::{human_size, letter, PointResult};

/// One backend at one point of one workload.
#[derive(Debug, Clone)]
pub struct Row {
    /// "kv" or "contig".
    pub workload: &'static str,
    pub op: Op,
    /// kv; seq (contiguous requests) or rand (file blocks shuffled) for contig.
    pub layout: &'static str,
    pub block: u64,
    /// Descriptors per request.
    pub descs: u64,
    pub threads: usize,
    pub backend: usize,
    /// Median over rounds (contig: one round).
    pub gbps: f64,
    pub cpu_s_per_gb: f64,
    pub avg_lat_us: Option<f64>,
    pub gbps_rounds: Vec<f64>,
    /// None: not checked.
    pub verified: Option<bool>,
}

impl Row {
    fn key(&self) -> (&'static str, Op, &'static str, u64, u64) {
        (self.workload, self.op, self.layout, self.block, self.descs)
    }

    fn iops(&self) -> f64 {
        self.gbps * 1e9 / self.block as f64
    }
}

pub fn kv_rows(points: &[kv::Point]) -> Vec<Row> {
    let mut rows = Vec::new();
    for p in points {
        for (b, s) in p.samples.iter().enumerate() {
            if s.is_empty() {
                continue;
            }
            rows.push(Row {
                workload: "kv",
                op: p.op,
                layout: "kv",
                block: p.block,
                descs: p.blocks,
                threads: 1,
                backend: b,
                gbps: p.median_gbps(b),
                cpu_s_per_gb: p.median_cpu(b),
                avg_lat_us: None,
                gbps_rounds: s.iter().map(|x| x.gbps).collect(),
                verified: p.verified(b),
            });
        }
    }
    rows
}

/// The per-request workload's rows (results.csv): workload req (make_prepped per request),
/// req-init or req-repost; layout kv (scattered) or contig.
pub fn req_rows(points: &[crate::req::Point]) -> Vec<Row> {
    use crate::req::Mode;
    let mut rows = Vec::new();
    for p in points {
        for (b, per_mode) in p.samples.iter().enumerate() {
            for m in Mode::ALL {
                let s = &per_mode[m as usize];
                if s.is_empty() {
                    continue;
                }
                rows.push(Row {
                    workload: match m {
                        Mode::Prepped => "req",
                        Mode::Init => "req-init",
                        Mode::Repost => "req-repost",
                    },
                    op: p.op,
                    layout: if p.contig { "contig" } else { "kv" },
                    block: p.block,
                    descs: p.blocks,
                    threads: 1,
                    backend: b,
                    gbps: p.med(b, m, |x| x.gbps),
                    cpu_s_per_gb: p.med(b, m, |x| x.cpu_s_per_gb),
                    avg_lat_us: Some(p.med(b, m, |x| (x.prep_ms + x.post_ms + x.release_ms) * 1e3)),
                    gbps_rounds: s.iter().map(|x| x.gbps).collect(),
                    verified: p.verified(b, m),
                });
            }
        }
    }
    rows
}

pub fn contig_rows(results: &[Vec<PointResult>], randomized: bool) -> Vec<Row> {
    let mut rows = Vec::new();
    for (b, res) in results.iter().enumerate() {
        for r in res {
            rows.push(Row {
                workload: "contig",
                op: r.op,
                layout: if randomized { "rand" } else { "seq" },
                block: r.block,
                descs: r.batch,
                threads: r.threads,
                backend: b,
                gbps: r.gbps(),
                cpu_s_per_gb: r.cpu_s_per_gb(),
                avg_lat_us: Some(r.avg_lat_us()),
                gbps_rounds: vec![r.gbps()],
                verified: r.consistency.as_ref().map(|c| c.is_ok()),
            });
        }
    }
    rows
}

/// GB/s of `r` over the first baseline's (backend 1) at the same point.
fn ratio(rows: &[Row], r: &Row) -> Option<f64> {
    let base = rows.iter().find(|x| x.backend == 1 && x.key() == r.key())?;
    (base.gbps > 0.0 && r.gbps.is_finite()).then(|| r.gbps / base.gbps)
}

fn num(v: f64, prec: usize) -> String {
    if v.is_finite() {
        format!("{v:.prec$}")
    } else {
        String::new()
    }
}

fn verified_str(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "FAILED",
        None => "not checked",
    }
}

pub const CSV_HEADER: &str =
    "workload,op,layout,block,descs,threads,backend_index,backend,gbps,iops,cpu_s_per_gb,\
avg_lat_us,rounds,gbps_rounds,ratio_vs_baseline,verified,background_load";

pub fn csv(labels: &[String], rows: &[Row], background_load: usize) -> String {
    let mut out = format!("{CSV_HEADER}\n");
    for r in rows {
        out.push_str(&format!(
            "{},{},{},{},{},{},{},\"{}\",{},{},{},{},{},{},{},{},{}\n",
            r.workload,
            r.op,
            r.layout,
            r.block,
            r.descs,
            r.threads,
            r.backend,
            labels[r.backend].replace('"', "'"),
            num(r.gbps, 6),
            num(r.iops(), 1),
            num(r.cpu_s_per_gb, 4),
            r.avg_lat_us.map(|v| num(v, 3)).unwrap_or_default(),
            r.gbps_rounds.len(),
            r.gbps_rounds
                .iter()
                .map(|g| num(*g, 6))
                .collect::<Vec<_>>()
                .join(";"),
            ratio(rows, r).map(|v| num(v, 4)).unwrap_or_default(),
            verified_str(r.verified),
            background_load
        ));
    }
    out
}

fn md_table(labels: &[String], rows: &[Row], workload: &str, op: Op) -> String {
    let mut keys: Vec<(&'static str, Op, &'static str, u64, u64)> = Vec::new();
    for r in rows.iter().filter(|r| r.workload == workload && r.op == op) {
        if !keys.contains(&r.key()) {
            keys.push(r.key());
        }
    }
    if keys.is_empty() {
        return String::new();
    }
    keys.sort_by_key(|k| {
        (
            k.4 != 1 && workload == "contig",
            if workload == "contig" { k.4 } else { 0 },
            k.3,
        )
    });
    let nb = labels.len();
    let mut s = String::from("| op | block | descriptors |");
    let mut sep = String::from("|---|---:|---:|");
    for i in 0..nb {
        s.push_str(&format!(" [{0}] GB/s | [{0}] CPU s/GB |", letter(i)));
        sep.push_str("---:|---:|");
    }
    for i in (0..nb).filter(|&i| i != 1 && nb > 1) {
        s.push_str(&format!(" {}/B |", letter(i)));
        sep.push_str("---:|");
    }
    s.push_str(" verified |\n");
    sep.push_str("---|\n");
    s.push_str(&sep);
    for k in keys {
        let find = |b: usize| rows.iter().find(|r| r.backend == b && r.key() == k);
        let mut line = format!("| {} | {} | {} |", op, human_size(k.3), k.4);
        for b in 0..nb {
            match find(b) {
                Some(r) => line.push_str(&format!(
                    " {} | {} |",
                    num(r.gbps, 3),
                    num(r.cpu_s_per_gb, 3)
                )),
                None => line.push_str(" - | - |"),
            }
        }
        for b in (0..nb).filter(|&i| i != 1 && nb > 1) {
            let v = find(b).and_then(|r| ratio(rows, r));
            line.push_str(&format!(
                " {} |",
                v.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into())
            ));
        }
        let all: Vec<Option<bool>> = (0..nb).filter_map(find).map(|r| r.verified).collect();
        let v = if all.contains(&Some(false)) {
            "FAILED"
        } else if !all.is_empty() && all.iter().all(|v| *v == Some(true)) {
            "yes"
        } else {
            "not checked"
        };
        line.push_str(&format!(" {v} |\n"));
        s.push_str(&line);
    }
    s
}

/// results.md: what ran where, then the tables (KV first), then how to read them.
pub fn markdown(
    info: &[(String, String)],
    labels: &[String],
    rows: &[Row],
    notes: &[String],
    first: &str,
) -> String {
    let mut s = String::from("# iud-bench results\n\n");
    for (k, v) in info {
        s.push_str(&format!("- {k}: {}\n", v.replace('|', "\\|")));
    }
    s.push_str("\nBackends (each in its own agent):\n");
    for (i, l) in labels.iter().enumerate() {
        let role = match i {
            0 => " (measured)",
            1 => " (first baseline: the ratios are GB/s of X / GB/s of [B])",
            _ => "",
        };
        s.push_str(&format!("- [{}] `{l}`{role}\n", letter(i)));
    }
    s.push('\n');
    if !first.is_empty() {
        s.push_str(&format!(
            "## Per request (what clients wait for)\n\n{first}\n"
        ));
    }
    for (workload, title) in [
        ("kv", "KV-cache pattern: scattered blocks, random non-adjacent file offsets, medians of rounds"),
        ("contig", "nixlbench-style sweep (one run per point)"),
    ] {
        for op in [Op::Read, Op::Write] {
            let t = md_table(labels, rows, workload, op);
            if !t.is_empty() {
                s.push_str(&format!("## {title}: {op}\n\n{t}\n"));
            }
        }
    }
    s.push_str("## Notes\n\n");
    for n in notes {
        s.push_str(&format!("- {n}\n"));
    }
    s
}

pub fn write(dir: &Path, md: &str, csv: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--out_dir {}: {e}", dir.display()))?;
    for (name, text) in [("results.md", md), ("results.csv", csv)] {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(backend: usize, gbps: f64) -> Row {
        Row {
            workload: "kv",
            op: Op::Read,
            layout: "kv",
            block: 16384,
            descs: 64,
            threads: 1,
            backend,
            gbps,
            cpu_s_per_gb: 0.5,
            avg_lat_us: None,
            gbps_rounds: vec![gbps, gbps + 1.0, gbps - 1.0],
            verified: Some(true),
        }
    }

    #[test]
    fn csv_and_markdown_carry_ratios_vs_the_first_baseline() {
        let labels = vec![
            "IUD".to_string(),
            "POSIX:u".to_string(),
            "POSIX:a".to_string(),
        ];
        let rows = vec![row(0, 4.0), row(1, 2.0), row(2, 1.0)];
        let c = csv(&labels, &rows, 2);
        let lines: Vec<&str> = c.lines().collect();
        assert_eq!(lines[0], CSV_HEADER);
        assert_eq!(lines[1], "kv,READ,kv,16384,64,1,0,\"IUD\",4.000000,244140.6,0.5000,,3,4.000000;5.000000;3.000000,2.0000,yes,2");
        assert!(lines[3].contains(",0.5000,yes,2"), "{}", lines[3]);
        let md = markdown(
            &[("date".into(), "now".into())],
            &labels,
            &rows,
            &["n".into()],
            "",
        );
        assert!(md.contains("| READ | 16K | 64 | 4.000 | 0.500 | 2.000 | 0.500 | 1.000 | 0.500 | 2.00x | 0.50x | yes |"), "{md}");
    }
}
