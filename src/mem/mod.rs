//! Registered memory and storage, one module per NIXL memory kind.
//!
//! A registration is handed to NIXL as an opaque MD pointer (an `Arc<Registration>` turned
//! into a raw pointer). Prepared requests clone the Arc, so a registration's resources (pinned
//! fixed-buffer slots, a path-mode fd, a fixed-file slot) live until the last request that uses
//! it is released, even if NIXL deregisters it first.

pub mod dmabuf_slabs;
pub mod dram;
pub mod file;
pub mod live;
pub mod path_meta;
pub mod udmabuf;
pub mod vram;

pub use dram::DramRegion;
pub use file::FileRegion;
pub use vram::VramRegion;

/// NIXL memory kinds (`nixl_mem_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    Dram,
    Vram,
    Blk,
    Obj,
    File,
}

impl MemKind {
    pub fn from_nixl(value: i32) -> Option<MemKind> {
        Some(match value {
            0 => MemKind::Dram,
            1 => MemKind::Vram,
            2 => MemKind::Blk,
            3 => MemKind::Obj,
            4 => MemKind::File,
            _ => return None,
        })
    }

    /// The `nixl_mem_t` number.
    pub fn to_nixl(self) -> i32 {
        match self {
            MemKind::Dram => 0,
            MemKind::Vram => 1,
            MemKind::Blk => 2,
            MemKind::Obj => 3,
            MemKind::File => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MemKind::Dram => "DRAM_SEG",
            MemKind::Vram => "VRAM_SEG",
            MemKind::Blk => "BLK_SEG",
            MemKind::Obj => "OBJ_SEG",
            MemKind::File => "FILE_SEG",
        }
    }
}

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
            Registration::Storage(f) => (f.offset, f.offset.saturating_add(f.len)),
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
