//! A scatter kernel for packed staging buffers: one launch moves every piece of a buffer to its
//! own device address, instead of one batched copy call whose cost grows with the pieces.
//!
//! Why: on the H200 cuMemcpyBatchAsync_v2 costs the submitting thread 0.9 us per piece in
//! isolation and 1.4-1.9 us inside the plugin (bench/results/2026-12-02-gpu-h200-session21.md):
//! a 16 KiB KV READ request of 8192 blocks spends 11-16 ms of its 14-19 ms queueing copies. A
//! launch costs the same for 1 or `PIECES_PER_LAUNCH` pieces.
//!
//! The kernel is hand-written PTX (the build has no CUDA toolkit; the driver JIT-compiles PTX
//! once per context, cuModuleLoadData), checked with ptxas 12.9 for sm_52, sm_80 and sm_90. Its
//! arguments: the source base (the staging buffer as the device sees it, mapped host memory or a
//! VRAM mirror), the piece count, and a table of (destination, source offset, length) in the
//! parameter space (at most 4 KiB of parameters on every architecture: 240 pieces per launch).
//! Block (x, y) copies piece x in 16-byte vectors, strided over the y blocks of that piece, so
//! every piece needs 16-byte aligned addresses and a length that is a multiple of 16.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::gpu::provider::{CopyPiece, PackedCopy};

/// Most pieces in one launch (the parameter table: 240 x 16 bytes, within 4 KiB).
pub const PIECES_PER_LAUNCH: usize = 240;
const THREADS: u32 = 256;
/// Bytes one block copies per loop round (THREADS x 16).
const BLOCK_BYTES: u64 = THREADS as u64 * 16;
/// Most blocks per piece (y dimension of the grid).
const BLOCKS_PER_PIECE_MAX: u64 = 64;

const PTX: &str = r#".version 7.0
.target sm_52
.address_size 64

.visible .entry iud_scatter(
    .param .u64 src_base,
    .param .u32 count,
    .param .align 8 .b8 pieces[3840]
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<12>;

    mov.u32 %r1, %ctaid.x;
    ld.param.u32 %r2, [count];
    setp.ge.u32 %p1, %r1, %r2;
    @%p1 bra DONE;
    mov.u64 %rd1, pieces;
    mul.wide.u32 %rd2, %r1, 16;
    add.u64 %rd3, %rd1, %rd2;
    ld.param.u64 %rd4, [%rd3];
    ld.param.u32 %r3, [%rd3+8];
    ld.param.u32 %r4, [%rd3+12];
    ld.param.u64 %rd5, [src_base];
    cvt.u64.u32 %rd6, %r3;
    add.u64 %rd5, %rd5, %rd6;
    mov.u32 %r5, %ctaid.y;
    mov.u32 %r6, %ntid.x;
    mov.u32 %r7, %tid.x;
    mad.lo.u32 %r8, %r5, %r6, %r7;
    shl.b32 %r8, %r8, 4;
    mov.u32 %r9, %nctaid.y;
    mul.lo.u32 %r10, %r9, %r6;
    shl.b32 %r10, %r10, 4;
LOOP:
    setp.ge.u32 %p2, %r8, %r4;
    @%p2 bra DONE;
    cvt.u64.u32 %rd7, %r8;
    add.u64 %rd8, %rd5, %rd7;
    ld.global.v4.u32 {%r11, %r12, %r13, %r14}, [%rd8];
    add.u64 %rd9, %rd4, %rd7;
    st.global.v4.u32 [%rd9], {%r11, %r12, %r13, %r14};
    add.u32 %r8, %r8, %r10;
    bra LOOP;
DONE:
    ret;
}
"#;

/// One piece: destination device address, offset from the source base, length.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Piece {
    pub dst: u64,
    pub src_offset: u32,
    pub len: u32,
}

/// The parameter table of one launch (layout of the kernel's `pieces` parameter).
#[repr(C, align(8))]
struct Table([Piece; PIECES_PER_LAUNCH]);

/// Whether the kernel can move these pieces: 16-byte aligned addresses and lengths, offsets and
/// lengths within 32 bits.
pub fn fits(dst: u64, src_offset: u64, len: u64) -> bool {
    dst % 16 == 0
        && src_offset % 16 == 0
        && len % 16 == 0
        && src_offset + len <= u64::from(u32::MAX)
}

/// Buffers of pieces up to this size (on average) take the kernel under `staging_copy=auto`: on
/// the H200 it moves 8192 scattered 16 KiB blocks at 28.6 GB/s against 8.4 with
/// cuMemcpyBatchAsync, 64 KiB at 33.5 against 28.6, and 256 KiB at 38.1 against 40.1 (the batched
/// copy wins there: few pieces per call, and the copy engine reads the bus better than the kernel).
const AUTO_PIECE_MAX: u64 = 64 << 10;

/// The copy a packed buffer takes: `Auto` resolves by the pieces' mean size.
pub fn resolve(asked: PackedCopy, pieces: &[CopyPiece]) -> PackedCopy {
    match asked {
        PackedCopy::Auto
            if pieces.iter().map(|p| p.len).sum::<u64>()
                <= AUTO_PIECE_MAX * pieces.len() as u64 =>
        {
            PackedCopy::Kernel
        }
        PackedCopy::Auto => PackedCopy::Batch,
        other => other,
    }
}

/// Logs once why packed staging copies took the batched copy instead of the kernel.
pub fn not_used(why: &str) {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    if !LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(
            "staging scatter kernel not used ({why}); packed staging copies use the batched copy"
        );
    }
}

/// Set when a launch was refused: the process's packed copies take the batched copy from then on.
static DISABLED: AtomicBool = AtomicBool::new(false);

pub fn enabled() -> bool {
    !DISABLED.load(Ordering::Relaxed)
}

/// Turns the kernel off for the process after a refused launch, saying why once.
pub fn disable(why: &str) {
    if !DISABLED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "staging scatter kernel launch refused ({why}); packed staging copies use the batched \
             copy from now on"
        );
    }
}

/// The address through which kernels of the current context reach the pinned host address
/// `host` (registered with CU_MEMHOSTREGISTER_DEVICEMAP).
pub fn mapped_address(host: u64) -> Result<u64, result::DriverError> {
    let mut mapped: sys::CUdeviceptr = 0;
    // sys: `result` has no cuPointerGetAttribute for this attribute.
    // SAFETY: writes one device pointer into a local; an unmapped address is an error code.
    unsafe {
        sys::cuPointerGetAttribute(
            &mut mapped as *mut _ as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
            host,
        )
    }
    .result()?;
    Ok(mapped)
}

/// The kernel, loaded into one context.
pub struct Scatter {
    func: sys::CUfunction,
}

// SAFETY: a CUfunction is a driver handle usable from any thread with its context current.
unsafe impl Send for Scatter {}
// SAFETY: as above; launching does not mutate the handle.
unsafe impl Sync for Scatter {}

impl Scatter {
    /// JIT-compiles the PTX into the current context. The module stays loaded for the process
    /// (the primary context is never released).
    pub fn load() -> Result<Scatter, String> {
        let image = std::ffi::CString::new(PTX).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated PTX image; the caller made the device's context current.
        let module = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(|e| format!("cuModuleLoadData: {e:?}"))?;
        // SAFETY: the module was just loaded.
        let func = unsafe { result::module::get_function(module, c"iud_scatter".to_owned()) }
            .map_err(|e| format!("cuModuleGetFunction: {e:?}"))?;
        Ok(Scatter { func })
    }

    /// Queues launches that copy `pieces` from `src_base + src_offset` to each `dst` on `stream`.
    ///
    /// # Safety
    /// Every range must stay valid until the stream passed the launches; the context of `stream`
    /// is current; every piece `fits`.
    pub unsafe fn launch(
        &self,
        stream: sys::CUstream,
        src_base: u64,
        pieces: &[Piece],
    ) -> Result<(), result::DriverError> {
        for chunk in pieces.chunks(PIECES_PER_LAUNCH) {
            let mut table = Table([Piece::default(); PIECES_PER_LAUNCH]);
            table.0[..chunk.len()].copy_from_slice(chunk);
            let longest = chunk.iter().map(|p| u64::from(p.len)).max().unwrap_or(0);
            let per_piece = longest.div_ceil(BLOCK_BYTES).clamp(1, BLOCKS_PER_PIECE_MAX) as u32;
            let (mut base, mut count) = (src_base, chunk.len() as u32);
            let mut params = [
                &mut base as *mut u64 as *mut c_void,
                &mut count as *mut u32 as *mut c_void,
                &mut table as *mut Table as *mut c_void,
            ];
            // SAFETY: the parameters match the kernel's signature (u64, u32, 3840 bytes); the
            // driver copies them at launch, so the locals may go out of scope after it.
            unsafe {
                result::launch_kernel(
                    self.func,
                    (count, per_piece, 1),
                    (THREADS, 1, 1),
                    0,
                    stream,
                    &mut params,
                )
            }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parameter_table_fits_the_kernel_signature() {
        assert_eq!(std::mem::size_of::<Piece>(), 16);
        assert_eq!(std::mem::size_of::<Table>(), 3840);
        assert!(PTX.contains(".b8 pieces[3840]"));
        // 8 (base) + 4 (count) + 4 (padding to 8) + the table: within the 4 KiB every GPU takes.
        assert!(8 + 8 + std::mem::size_of::<Table>() <= 4096);
    }

    #[test]
    fn only_aligned_pieces_fit() {
        assert!(fits(0x1000, 4096, 16384));
        assert!(
            !fits(0x1008, 4096, 16384),
            "destination not 16-byte aligned"
        );
        assert!(!fits(0x1000, 4096, 16385), "length not a multiple of 16");
        assert!(
            !fits(0x1000, u64::from(u32::MAX), 16),
            "offset beyond 32 bits"
        );
    }
}
