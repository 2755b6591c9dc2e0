//! Registered memory and storage, one module per NIXL memory kind.
//!
//! A registration is handed to NIXL as an opaque MD pointer (an `Arc<Registration>` turned
//! into a raw pointer). Prepared requests clone the Arc, so a registration's resources (pinned
//! fixed-buffer slots, a path-mode fd, a fixed-file slot) live until the last request that uses
//! it is released, even if NIXL deregisters it first.

pub mod dmabuf_slabs;
pub mod dram;
pub mod file;
pub mod file_query;
pub mod huge_pages;
mod kind;
pub mod live;
pub mod path_meta;
pub mod udmabuf;
pub mod vram;

pub use dram::DramRegion;
pub use file::FileRegion;
pub use kind::MemKind;
pub use vram::VramRegion;

/// One registration of the engine.
#[derive(Debug)]
pub enum Registration {
    Dram(DramRegion),
    Vram(VramRegion),
    /// FILE_SEG or BLK_SEG (the region knows which).
    Storage(FileRegion),
}

impl Registration {
    pub fn kind(&self) -> MemKind {
        match self {
            Registration::Dram(_) => MemKind::Dram,
            Registration::Vram(_) => MemKind::Vram,
            Registration::Storage(f) => f.kind,
        }
    }

    /// `[start, end)` of the registered range: addresses for memory, offsets for files.
    pub fn range(&self) -> (u64, u64) {
        match self {
            Registration::Dram(d) => (d.addr, d.addr + d.len),
            Registration::Vram(v) => (v.addr, v.addr + v.len),
            Registration::Storage(f) => (f.offset, f.offset + f.len),
        }
    }

    pub fn dev_id(&self) -> u64 {
        match self {
            Registration::Dram(d) => d.dev_id,
            Registration::Vram(v) => v.device as u64,
            Registration::Storage(f) => f.dev_id,
        }
    }
}
