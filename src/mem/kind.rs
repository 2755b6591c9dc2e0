//! NIXL memory kinds (`nixl_mem_t`) and their names.

/// NIXL memory kinds (`nixl_mem_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
