//! `iud-doctor`: what this machine offers the IO_URING_DMABUF plugin, and which path `auto`
//! would take for each memory x storage pair. Read-only: it allocates a little GPU memory to try a
//! DMA-BUF export and touches no storage.

use io_uring::{opcode, register::Probe, IoUring};
use io_uring_dmabuf::engine::dmabuf_support;
use io_uring_dmabuf::error::{Error, Result};
use io_uring_dmabuf::gpu::{self, ProviderChoice};
use io_uring_dmabuf::uring::dmabuf_uapi::DmabufSupport;

fn main() {
    println!(
        "IO_URING_DMABUF doctor ({} {})",
        io_uring_dmabuf::ffi::manifest::PLUGIN_NAME,
        env!("CARGO_PKG_VERSION")
    );
    println!(
        "kernel: {}",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );
    let uring_ok = report_io_uring();
    let dmabuf = dmabuf_support();
    println!(
        "io_uring DMA-BUF uAPI: {}",
        match dmabuf {
            DmabufSupport::Available => "available".to_owned(),
            DmabufSupport::Absent(why) => format!("absent: {why}"),
        }
    );
    // No released kernel has it: say where its status is kept rather than a version.
    println!(
        "  (the uAPI comes from an unmerged patch series; status and sources: \
         docs/kernel-dmabuf-series.md)"
    );
    let udmabuf = std::path::Path::new("/dev/udmabuf").exists();
    println!(
        "udmabuf (/dev/udmabuf): {}",
        if udmabuf { "present" } else { "absent" }
    );
    let p2pdma = std::fs::read_to_string("/proc/kallsyms")
        .map(|k| k.contains("p2pdma_pgmap_ops"))
        .unwrap_or(false);
    println!(
        "PCI P2PDMA in kernel (p2pdma_pgmap_ops): {}",
        if p2pdma {
            "yes"
        } else {
            "no (or kallsyms hidden)"
        }
    );
    let nvme: Vec<String> = std::fs::read_dir("/sys/class/nvme")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    println!(
        "NVMe controllers: {}",
        if nvme.is_empty() {
            "none".to_owned()
        } else {
            nvme.join(", ")
        }
    );

    let gpu_export = report_gpu();
    for line in gpu::rocm::doctor_report()
        .into_iter()
        .chain(gpu::vulkan::doctor_report())
    {
        println!("{line}");
    }
    report_cufile(p2pdma);

    println!("auto would choose:");
    println!(
        "  DRAM <-> FILE: {}",
        if uring_ok {
            "io_uring, DRAM as fixed buffers"
        } else {
            "unavailable (io_uring refused)"
        }
    );
    println!(
        "  DRAM <-> BLK:  {}",
        if uring_ok {
            "io_uring O_DIRECT, DRAM as fixed buffers"
        } else {
            "unavailable (io_uring refused)"
        }
    );
    let vram_file = match &gpu_export {
        None => "unavailable (no GPU provider)".to_owned(),
        Some(_) => match io_uring_dmabuf::gpu::cufile::mode() {
            (true, mode) => format!("cufile ({mode})"),
            (false, mode) => format!(
                "staging (io_uring DMA-BUF I/O exists only for raw NVMe block devices; cuFile \
                 would run in {mode})"
            ),
        },
    };
    println!("  VRAM <-> FILE: {vram_file}");
    let vram_blk = match (&gpu_export, dmabuf) {
        (None, _) => "unavailable (no GPU provider)".to_owned(),
        (Some(Ok(())), DmabufSupport::Available) => {
            "dmabuf on NVMe namespaces opened O_DIRECT, after the self-test; staging elsewhere"
                .to_owned()
        }
        (Some(Err(e)), DmabufSupport::Available) => format!("staging (DMA-BUF export failed: {e})"),
        (Some(_), DmabufSupport::Absent(why)) => format!("staging (dmabuf: {why})"),
    };
    println!("  VRAM <-> BLK:  {vram_blk}");
}

/// Ring setup, features and the opcodes the plugin uses.
fn report_io_uring() -> bool {
    let ring = match IoUring::new(8) {
        Ok(r) => r,
        Err(e) => {
            println!("io_uring: unavailable ({e})");
            return false;
        }
    };
    let p = ring.params();
    let feats = [
        ("NODROP", p.is_feature_nodrop()),
        ("SUBMIT_STABLE", p.is_feature_submit_stable()),
        ("RW_CUR_POS", p.is_feature_rw_cur_pos()),
        ("FAST_POLL", p.is_feature_fast_poll()),
        ("EXT_ARG", p.is_feature_ext_arg()),
        ("NATIVE_WORKERS", p.is_feature_native_workers()),
        ("RSRC_TAGS", p.is_feature_resource_tagging()),
    ];
    let on: Vec<&str> = feats.iter().filter(|f| f.1).map(|f| f.0).collect();
    println!("io_uring: available; features {}", on.join(" "));
    let mut probe = Probe::new();
    if ring.submitter().register_probe(&mut probe).is_ok() {
        let ops = [
            ("READ", opcode::Read::CODE),
            ("WRITE", opcode::Write::CODE),
            ("READ_FIXED", opcode::ReadFixed::CODE),
            ("WRITE_FIXED", opcode::WriteFixed::CODE),
            ("ASYNC_CANCEL", opcode::AsyncCancel::CODE),
        ];
        let missing: Vec<&str> = ops
            .iter()
            .filter(|o| !probe.is_supported(o.1))
            .map(|o| o.0)
            .collect();
        println!(
            "io_uring opcodes used by the plugin: {}",
            if missing.is_empty() {
                "all supported".to_owned()
            } else {
                format!("missing {}", missing.join(" "))
            }
        );
    }
    let sparse = ring.submitter().register_buffers_sparse(16).is_ok();
    println!(
        "io_uring sparse fixed-buffer table: {}",
        if sparse { "yes" } else { "no" }
    );
    true
}

/// GPU provider, devices, DMA-BUF export support and a real export of a 2.5 GiB allocation cut
/// into 1 GiB slabs. Returns None without a provider, else the export outcome.
fn report_gpu() -> Option<Result<()>> {
    let provider = match gpu::load(ProviderChoice::Auto) {
        Ok(p) => p,
        Err(e) => {
            println!("GPU: {}", e.message);
            return None;
        }
    };
    println!("GPU provider {}: {}", provider.name(), provider.describe());
    let cuda = gpu::cuda::Cuda::load().ok()?;
    for d in 0..provider.device_count() {
        println!(
            "  GPU {d}: DMA-BUF export supported (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED): {:?}",
            cuda.dmabuf_supported(d).map_err(|e| e.message)
        );
    }
    if provider.device_count() == 0 {
        return Some(Err(Error::not_found("no devices")));
    }
    let r = gpu::cuda::export_probe(&cuda, 0, 5 << 29, io_uring_dmabuf::uring::MAX_FIXED_BUFFER);
    match &r {
        Ok(slabs) => println!("  DMA-BUF export of a 2.5 GiB allocation as {slabs} slabs: ok"),
        Err(e) => println!("  DMA-BUF export: {}", e.message),
    }
    Some(r.map(drop))
}

/// libcufile: where it is, its version, whether the driver opens, the mode its driver properties
/// report, and whether it has the batch API.
fn report_cufile(p2pdma: bool) {
    use io_uring_dmabuf::gpu::cufile::CuFile;
    match CuFile::load() {
        Err(e) => println!("cuFile: {}", e.message),
        Ok(lib) => {
            let v = lib.version.map_or("unknown".to_owned(), |v| v.to_string());
            let props = match &lib.props {
                Ok(p) => p.describe(),
                Err(why) => why.message.clone(),
            };
            println!(
                "cuFile: {} loaded, version {v}, driver open; mode {props}",
                lib.path
            );
            println!(
                "cuFile batch API: {}",
                if lib.batch.is_some() {
                    "present"
                } else {
                    "absent"
                }
            );
            if p2pdma {
                println!(
                    "cuFile: the kernel has PCI P2PDMA; cufile.json's use_pci_p2pdma decides \
                     whether cuFile uses it"
                );
            }
        }
    }
}
