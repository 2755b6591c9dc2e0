//! What every GPU provider answers: the `GpuProvider` trait and the values it hands out.

use std::os::fd::OwnedFd;

use crate::error::Result;

/// A DMA-BUF exported for one slab: the fd and where the slab starts inside it.
pub struct DmabufExport {
    pub fd: OwnedFd,
    pub offset: u64,
    /// Set when the DMA-BUF covers a whole allocation larger than the range asked for (Vulkan
    /// exports whole allocations): its size, which the caller checks against its own limits.
    pub whole_size: Option<u64>,
}

impl From<OwnedFd> for DmabufExport {
    /// An export of exactly the requested range (offset 0).
    fn from(fd: OwnedFd) -> DmabufExport {
        DmabufExport {
            fd,
            offset: 0,
            whole_size: None,
        }
    }
}

/// A copy in flight on a device stream.
pub trait CopyTicket: Send {
    /// Non-blocking: has the copy finished? An error names the vendor's error.
    fn is_done(&self) -> Result<bool>;
    /// Blocks until the copy finished.
    fn wait(&self) -> Result<()>;
}

/// A copy that already happened when the call returned (a synchronous memcpy).
pub struct CopyFinished;

impl CopyTicket for CopyFinished {
    fn is_done(&self) -> Result<bool> {
        Ok(true)
    }
    fn wait(&self) -> Result<()> {
        Ok(())
    }
}

/// One piece of a batched copy: device address, host address, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPiece {
    pub dev: u64,
    pub host: u64,
    pub len: u64,
}

/// How a packed staging buffer (several pieces at scattered device addresses) reaches the GPU
/// (backend parameter `staging_copy`). Providers without a kernel path copy piece by piece
/// whatever is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedCopy {
    /// The provider picks per buffer (CUDA: `Kernel` for small pieces, else `Batch`).
    Auto,
    /// The driver's batched copy (CUDA: cuMemcpyBatchAsync), else one copy per piece.
    Batch,
    /// A scatter kernel reads the pinned staging buffer over the bus (mapped host memory).
    Kernel,
    /// One DMA of the buffer into a VRAM mirror, then the scatter kernel within VRAM.
    DmaKernel,
}

/// Several copies that complete together: done when every one is.
struct AllTickets(Vec<Box<dyn CopyTicket>>);

impl CopyTicket for AllTickets {
    fn is_done(&self) -> Result<bool> {
        for t in &self.0 {
            if !t.is_done()? {
                return Ok(false);
            }
        }
        Ok(true)
    }
    fn wait(&self) -> Result<()> {
        self.0.iter().try_for_each(|t| t.wait())
    }
}

/// The device memory of one allocation, as the provider sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// Start and end of the allocation that contains the registration.
    pub alloc_start: u64,
    pub alloc_end: u64,
}

pub trait GpuProvider: Send + Sync {
    fn name(&self) -> &'static str;
    /// Number of devices the provider sees.
    fn device_count(&self) -> i32;
    /// Fails unless `[addr, addr+len)` is device memory of `device`.
    fn check_device_range(&self, device: i32, addr: u64, len: u64) -> Result<DeviceRange>;
    /// Exports `[addr, addr+len)` (host-page aligned) as a DMA-BUF, with the offset at which
    /// `addr` sits inside it (0 when exactly the range is exported).
    fn export_dmabuf(&self, device: i32, addr: u64, len: u64) -> Result<DmabufExport>;
    /// Page-locks host memory for fast asynchronous copies.
    ///
    /// # Safety
    /// The memory must stay mapped until `unpin_host`.
    unsafe fn pin_host(&self, addr: u64, len: u64) -> Result<()>;
    fn unpin_host(&self, addr: u64);
    /// Starts a device -> host copy.
    ///
    /// # Safety
    /// Both ranges must stay valid until the ticket reports completion.
    unsafe fn copy_to_host(
        &self,
        device: i32,
        host: u64,
        dev: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>>;
    /// Starts a host -> device copy.
    ///
    /// # Safety
    /// Both ranges must stay valid until the ticket reports completion.
    unsafe fn copy_to_device(
        &self,
        device: i32,
        dev: u64,
        host: u64,
        len: u64,
    ) -> Result<Box<dyn CopyTicket>>;
    /// Starts the copies of several pieces in one direction (`to_host`: device -> host) on one
    /// device, with one ticket for all, the way `how` asks where the provider can (host -> device
    /// only). The default issues one copy per piece; providers with a batched copy call (CUDA's
    /// cuMemcpyBatchAsync), a scatter kernel or one stream override it. `lane`: the stream a
    /// scatter-kernel copy may take (CUDA: `KERNEL_LANES` streams; kernels on different lanes
    /// may overlap); DMA copies keep one stream per direction whatever the lane.
    ///
    /// # Safety
    /// Every range must stay valid until the ticket reports completion.
    unsafe fn copy_batch(
        &self,
        device: i32,
        pieces: &[CopyPiece],
        to_host: bool,
        how: PackedCopy,
        lane: usize,
    ) -> Result<Box<dyn CopyTicket>> {
        let _ = (how, lane);
        let mut tickets = Vec::with_capacity(pieces.len());
        for p in pieces {
            // SAFETY: forwarded from the caller.
            tickets.push(unsafe {
                if to_host {
                    self.copy_to_host(device, p.host, p.dev, p.len)
                } else {
                    self.copy_to_device(device, p.dev, p.host, p.len)
                }
            }?);
        }
        Ok(Box::new(AllTickets(tickets)))
    }
    /// Makes the device's context current on the calling thread (for vendor libraries such as
    /// cuFile that use the thread's context).
    fn make_current(&self, device: i32) -> Result<()>;
    /// One line about the provider (driver version, devices) for logs and the doctor.
    fn describe(&self) -> String;
    /// Orders the provider's next copies on `device` after the work the application already
    /// queued on the device's default stream, so a buffer a kernel is still writing is not read
    /// early (NIXL users hand over memory right after launching the kernel that fills it, as
    /// they may with cuFile, whose copies run on the default stream). With `host_wait` the
    /// calling thread also waits for that work (for paths where storage reads or writes the
    /// device memory directly). One-way: the application's later work does not wait for ours.
    fn fence_app_work(&self, device: i32, host_wait: bool) -> Result<()> {
        let _ = (device, host_wait);
        Ok(())
    }
}
