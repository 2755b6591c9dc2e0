//! Result rows, nixlbench-style tables and the side-by-side summary.

use crate::cli::Op;

#[derive(Debug, Clone)]
pub struct PointResult {
    pub op: Op,
    pub block: u64,
    pub batch: u64,
    /// Requests completed in the timed loops of all threads.
    pub iters: u64,
    pub threads: usize,
    /// Wall time from the first thread's start to the last thread's end of the timed loop.
    pub elapsed_s: f64,
    pub prep_us: Vec<f64>,
    pub post_us: Vec<f64>,
    pub tx_us: Vec<f64>,
    /// User+sys CPU seconds of the whole process over the timed loop (cpu::process_cpu_s).
    pub cpu_s: f64,
    /// None: not checked; Some(Ok): verified; Some(Err): mismatch description.
    pub consistency: Option<Result<(), String>>,
}

impl PointResult {
    pub fn bytes(&self) -> f64 {
        self.iters as f64 * self.batch as f64 * self.block as f64
    }

    pub fn gbps(&self) -> f64 {
        self.bytes() / self.elapsed_s / 1e9
    }

    /// Descriptors (I/Os of `block` bytes) completed per second.
    pub fn iops(&self) -> f64 {
        self.iters as f64 * self.batch as f64 / self.elapsed_s
    }

    /// CPU seconds per GB moved.
    pub fn cpu_s_per_gb(&self) -> f64 {
        crate::cpu::per_gb(self.cpu_s, self.bytes())
    }

    pub fn avg_lat_us(&self) -> f64 {
        let per_thread = self.iters as f64 / self.threads as f64;
        self.elapsed_s * 1e6 / per_thread
    }
}

pub fn avg(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// 99th percentile, nearest-rank.
pub fn p99(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = ((0.99 * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

pub const CSV_HEADER: &str =
    "backend,op,layout,block,batch,requests,ios,bytes,elapsed_s,gbps,iops,avg_lat_us,cpu_s_per_gb";

/// One `--csv` line (see CSV_HEADER); the backend label is quoted (it may hold ';' and ',').
pub fn csv_row(backend: &str, layout: &str, r: &PointResult) -> String {
    format!(
        "\"{}\",{},{layout},{},{},{},{},{:.0},{:.6},{:.6},{:.1},{:.3},{:.4}",
        backend.replace('"', "'"),
        r.op,
        r.block,
        r.batch,
        r.iters,
        r.iters * r.batch,
        r.bytes(),
        r.elapsed_s,
        r.gbps(),
        r.iops(),
        r.avg_lat_us(),
        r.cpu_s_per_gb()
    )
}

const W0: usize = 20;
const W: usize = 15;

pub fn table_header() -> String {
    let cols = [
        "Batch Size",
        "B/W (GB/Sec)",
        "Avg Lat. (us)",
        "Avg Prep (us)",
        "P99 Prep (us)",
        "Avg Post (us)",
        "P99 Post (us)",
        "Avg Tx (us)",
        "P99 Tx (us)",
        "IOPS",
        "CPU s/GB",
    ];
    let mut s = format!("{:<W0$}", "Block Size (B)");
    for c in cols {
        s.push_str(&format!("{c:<W$}"));
    }
    let line = "-".repeat(s.trim_end().len());
    format!("{}\n{line}", s.trim_end())
}

pub fn table_row(r: &PointResult) -> String {
    let s = format!(
        "{:<W0$}{:<W$}{:<W$.6}{:<W$.3}{:<W$.3}{:<W$.3}{:<W$.3}{:<W$.3}{:<W$.3}{:<W$.3}{:<W$.0}{:<W$.4}",
        r.block,
        r.batch,
        r.gbps(),
        r.avg_lat_us(),
        avg(&r.prep_us),
        p99(&r.prep_us),
        avg(&r.post_us),
        p99(&r.post_us),
        avg(&r.tx_us),
        p99(&r.tx_us),
        r.iops(),
        r.cpu_s_per_gb(),
    );
    s.trim_end().to_string()
}

pub fn human_size(b: u64) -> String {
    if b >= 1 << 30 && b % (1 << 30) == 0 {
        format!("{}G", b >> 30)
    } else if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Block size x op (x batch) table with GB/s and ops/s per backend and the ratio of the first
/// backend's ops/s to each other backend's.
pub fn letter(i: usize) -> String {
    ((b'A' + (i % 26) as u8) as char).to_string()
}

pub fn summary(labels: &[String], results: &[Vec<PointResult>], ops: &[Op]) -> String {
    let mut out = String::new();
    out.push_str("Backends: ");
    out.push_str(
        &labels
            .iter()
            .enumerate()
            .map(|(i, l)| format!("[{}] {l}", letter(i)))
            .collect::<Vec<_>>()
            .join("  "),
    );
    out.push('\n');
    out.push_str(
        "GB/s decimal; ops/s = descriptors (I/Os of one block) completed per second; \
         cpu = CPU s/GB (user+sys of the process over the timed loop, per GB moved); \
         A/X = ops/s of [A] / ops/s of [X] (>1: [A] faster)\n\n",
    );
    let mut hdr = format!("{:<6}{:>10}{:>7}", "Op", "Block", "Batch");
    for i in 0..labels.len() {
        hdr.push_str(&format!(
            "{:>10}{:>10}{:>8}",
            format!("{} GB/s", letter(i)),
            format!("{} ops/s", letter(i)),
            format!("{} cpu", letter(i))
        ));
    }
    for i in 1..labels.len() {
        hdr.push_str(&format!("{:>8}", format!("A/{}", letter(i))));
    }
    out.push_str(&hdr);
    out.push('\n');
    out.push_str(&"-".repeat(hdr.len()));
    out.push('\n');
    // Row keys in the order the first backend with results produced them.
    let mut keys: Vec<(Op, u64, u64)> = Vec::new();
    for op in ops {
        for res in results {
            for r in res.iter().filter(|r| r.op == *op) {
                if !keys.contains(&(r.op, r.block, r.batch)) {
                    keys.push((r.op, r.block, r.batch));
                }
            }
        }
    }
    for (op, block, batch) in keys {
        let find = |i: usize| {
            results.get(i).and_then(|res| {
                res.iter()
                    .find(|r| r.op == op && r.block == block && r.batch == batch)
            })
        };
        let mut row = format!("{:<6}{:>10}{:>7}", op.to_string(), human_size(block), batch);
        for i in 0..labels.len() {
            match find(i) {
                Some(r) => row.push_str(&format!(
                    "{:>10.3}{:>10}{:>8.3}",
                    r.gbps(),
                    si(r.iops()),
                    r.cpu_s_per_gb()
                )),
                None => row.push_str(&format!("{:>10}{:>10}{:>8}", "-", "-", "-")),
            }
        }
        for i in 1..labels.len() {
            match (find(0), find(i)) {
                (Some(a), Some(x)) if x.iops() > 0.0 => {
                    row.push_str(&format!("{:>8.2}", a.iops() / x.iops()))
                }
                _ => row.push_str(&format!("{:>8}", "-")),
            }
        }
        out.push_str(&row);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(p99(&v), 99.0);
        assert_eq!(p99(&[5.0]), 5.0);
        assert_eq!(avg(&[1.0, 3.0]), 2.0);
    }

    #[test]
    fn row_math() {
        let r = PointResult {
            op: Op::Read,
            block: 4096,
            batch: 2,
            iters: 1000,
            threads: 1,
            elapsed_s: 0.5,
            prep_us: vec![10.0],
            post_us: vec![1.0; 1000],
            tx_us: vec![2.0; 1000],
            cpu_s: 0.004096,
            consistency: None,
        };
        assert!((r.iops() - 4000.0).abs() < 1e-9);
        assert!((r.gbps() - 4000.0 * 4096.0 / 1e9).abs() < 1e-12);
        assert!((r.avg_lat_us() - 500.0).abs() < 1e-9);
        assert!(table_row(&r).starts_with("4096"));
        let s = summary(
            &["X".into(), "Y".into()],
            &[vec![r.clone()], vec![r.clone()]],
            &[Op::Read],
        );
        assert!(s.contains("1.00"), "{s}");
        assert_eq!(
            csv_row("A:x=1", "rand", &r),
            "\"A:x=1\",READ,rand,4096,2,1000,2000,8192000,0.500000,0.016384,4000.0,500.000,0.5000"
        );
    }
}
