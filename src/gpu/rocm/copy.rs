//! The staging side of the ROCm provider: pinned host memory and asynchronous host<->device
//! copies whose completion signal is the copy ticket.
//!
//! Pinning uses `hsa_amd_memory_lock`: the staging pool maps its own buffers and asks the
//! provider to pin that existing memory (the HSA counterpart of cuMemHostRegister); allocating
//! from a system memory pool instead would hand the pool memory it did not map. Locking may give
//! the agents another address for the same pages, so copies use the address HSA returned.

use super::runtime::Rocm;
use super::status::HsaStatus;
use super::sys::{self, Lib, Signal};
use crate::error::{Error, Result};
use crate::gpu::provider::CopyTicket;

/// Pins `[addr, addr+len)` for all agents and remembers the agents' address of it.
///
/// # Safety
/// The memory must stay mapped until `unpin`.
pub unsafe fn pin(rocm: &Rocm, addr: u64, len: u64) -> Result<()> {
    let agent_addr = lock(rocm.lib, addr, len)?;
    rocm.locked
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((addr, len, agent_addr));
    Ok(())
}

pub fn unpin(rocm: &Rocm, addr: u64) {
    let mut locked = rocm.locked.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = locked.iter().position(|&(start, _, _)| start == addr) {
        locked.swap_remove(i);
        drop(locked);
        unlock(rocm.lib, addr);
    }
}

/// `hsa_amd_memory_lock` for all agents (NULL list); returns the address agents use.
fn lock(lib: &Lib, addr: u64, len: u64) -> Result<u64> {
    let mut agent_ptr: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: the caller keeps the memory mapped while locked; agent_ptr is a valid out-param.
    let st = unsafe {
        (lib.memory_lock)(
            addr as *mut _,
            len as usize,
            std::ptr::null_mut(),
            0,
            &mut agent_ptr,
        )
    };
    lib.check(&format!("hsa_amd_memory_lock(0x{addr:x}+{len})"), st)?;
    Ok(if agent_ptr.is_null() {
        addr
    } else {
        agent_ptr as u64
    })
}

fn unlock(lib: &Lib, addr: u64) {
    // SAFETY: `addr` was locked by `lock` and is unlocked once.
    let st = unsafe { (lib.memory_unlock)(addr as *mut _) };
    if let Err(e) = lib.check(&format!("hsa_amd_memory_unlock(0x{addr:x})"), st) {
        tracing::warn!("{}", e.message);
    }
}

/// Starts one copy between host memory and device `device`.
///
/// # Safety
/// Both ranges must stay valid until the ticket reports completion (or is dropped: dropping
/// waits for the copy).
pub unsafe fn start(
    rocm: &Rocm,
    device: i32,
    host: u64,
    dev: u64,
    len: u64,
    to_host: bool,
) -> Result<Box<dyn CopyTicket>> {
    let gpu = rocm.gpu(device)?.agent;
    let cpu = rocm
        .cpu
        .ok_or_else(|| Error::backend("HSA lists no CPU agent for the host side of copies"))?;
    let what = if to_host {
        format!("device->host copy 0x{dev:x} -> 0x{host:x} ({len} bytes)")
    } else {
        format!("host->device copy 0x{host:x} -> 0x{dev:x} ({len} bytes)")
    };
    // Pinned staging memory is used where HSA mapped it for the agents. Other host memory (the
    // dmabuf self-test's block) is locked for this one copy and unlocked when the ticket drops.
    let pinned = rocm
        .locked
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|&&(s, l, _)| host >= s && host + len <= s + l)
        .map(|&(s, _, a)| a + (host - s));
    let (host_agent_addr, temp_lock) = match pinned {
        Some(a) => (a, None),
        None => (
            lock(rocm.lib, host, len)
                .map_err(|e| Error::new(e.kind, format!("{what}: {}", e.message)))?,
            Some(host),
        ),
    };
    let mut ticket = SignalTicket {
        lib: rocm.lib,
        signal: None,
        temp_lock,
        what,
    };
    let mut signal = Signal { handle: 0 };
    // SAFETY: initial value 1, any consumer (0, NULL); writes the handle into `signal`.
    let st = unsafe { (rocm.lib.signal_create)(1, 0, std::ptr::null(), &mut signal) };
    rocm.check("hsa_signal_create", st)
        .map_err(|e| Error::new(e.kind, format!("{}: {}", ticket.what, e.message)))?;
    ticket.signal = Some(signal);
    let (dst, dst_agent, src, src_agent) = if to_host {
        (host_agent_addr, cpu, dev, gpu)
    } else {
        (dev, gpu, host_agent_addr, cpu)
    };
    // SAFETY: the caller keeps both ranges valid until the ticket completes; the host range is
    // locked; the signal is live and decremented by the runtime when the copy ends.
    let st: HsaStatus = unsafe {
        (rocm.lib.async_copy)(
            dst as *mut _,
            dst_agent,
            src as *const _,
            src_agent,
            len as usize,
            0,
            std::ptr::null(),
            signal,
        )
    };
    if let Err(e) = rocm.check("hsa_amd_memory_async_copy", st) {
        // Nothing was queued: the ticket's drop destroys the signal without waiting on it.
        ticket.discard_signal();
        return Err(Error::new(
            e.kind,
            format!("{}: {}", ticket.what, e.message),
        ));
    }
    Ok(Box::new(ticket))
}

/// A copy in flight: done when its completion signal drops below 1; a negative value is how
/// HSA reports a failed copy.
struct SignalTicket {
    lib: &'static Lib,
    signal: Option<Signal>,
    temp_lock: Option<u64>,
    what: String,
}

impl SignalTicket {
    fn verdict(&self, value: sys::SignalValue) -> Result<bool> {
        match value {
            v if v < 0 => Err(Error::backend(format!(
                "{} failed: HSA set its completion signal to {v}",
                self.what
            ))),
            0 => Ok(true),
            _ => Ok(false),
        }
    }

    /// Marks a signal whose copy was never queued, so that drop does not wait for it.
    fn discard_signal(&mut self) {
        if let Some(s) = self.signal.take() {
            // SAFETY: the signal is ours and nothing uses it (the copy was refused).
            unsafe { (self.lib.signal_destroy)(s) };
        }
    }

    fn wait_value(&self, s: Signal) -> sys::SignalValue {
        loop {
            // SAFETY: a live signal; the wait may return early (spurious wake-up or timeout
            // hint), hence the loop.
            let v = unsafe {
                (self.lib.signal_wait_scacquire)(
                    s,
                    sys::SIGNAL_CONDITION_LT,
                    1,
                    u64::MAX,
                    sys::WAIT_STATE_BLOCKED,
                )
            };
            if v < 1 {
                return v;
            }
        }
    }
}

impl CopyTicket for SignalTicket {
    fn is_done(&self) -> Result<bool> {
        let Some(s) = self.signal else {
            return Ok(true);
        };
        // SAFETY: a live signal, read with acquire order so the copied bytes are visible.
        self.verdict(unsafe { (self.lib.signal_load_scacquire)(s) })
    }

    fn wait(&self) -> Result<()> {
        let Some(s) = self.signal else { return Ok(()) };
        self.verdict(self.wait_value(s)).map(drop)
    }
}

impl Drop for SignalTicket {
    fn drop(&mut self) {
        if let Some(s) = self.signal.take() {
            // A signal must not be destroyed, nor a temporary lock released, while the copy
            // still uses them: wait first (normally it has long completed).
            self.wait_value(s);
            // SAFETY: the copy has finished with the signal; destroyed once.
            let st = unsafe { (self.lib.signal_destroy)(s) };
            if let Err(e) = self.lib.check("hsa_signal_destroy", st) {
                tracing::warn!("{}", e.message);
            }
        }
        if let Some(host) = self.temp_lock.take() {
            unlock(self.lib, host);
        }
    }
}
