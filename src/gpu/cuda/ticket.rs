//! Copy tickets: a CUDA event recorded after a device's queued copies, polled or waited on by
//! the staging path. Finished tickets hand their event back to the device for reuse.

use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::{call, error_name, guard, Cuda, Device};
use crate::error::{Error, Result};
use crate::gpu::provider::CopyTicket;

struct EventTicket {
    event: sys::CUevent,
    device: Arc<Device>,
}

/// Spare events kept per device; more are destroyed (a request rarely has more copies in flight).
const SPARE_EVENTS_MAX: usize = 256;

// SAFETY: a CUDA event may be queried from any thread with its context current.
unsafe impl Send for EventTicket {}

impl CopyTicket for EventTicket {
    fn is_done(&self) -> Result<bool> {
        // SAFETY: ctx is a retained primary context; event is alive until drop.
        call("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(self.device.ctx)
        })?;
        // SAFETY: as above.
        match guard("cuEventQuery", || unsafe {
            result::event::query(self.event)
        })? {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(Error::backend(format!(
                "asynchronous device copy failed: {}",
                error_name(e)
            ))
            .with_vendor("cuda", e.0 as i64)),
        }
    }

    fn wait(&self) -> Result<()> {
        // SAFETY: as in is_done.
        call("cuCtxSetCurrent", || unsafe {
            result::ctx::set_current(self.device.ctx)
        })?;
        // SAFETY: as above.
        call("cuEventSynchronize", || unsafe {
            result::event::synchronize(self.event)
        })
    }
}

impl Drop for EventTicket {
    fn drop(&mut self) {
        // Re-recording a spare event replaces its previous capture, so even an event whose copy
        // is still pending (a failing request) is safe to reuse.
        let mut spare = self
            .device
            .spare_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if spare.len() < SPARE_EVENTS_MAX {
            spare.push(self.event);
            return;
        }
        drop(spare);
        // SAFETY: the event was created by us and is destroyed once; a pending event may be
        // destroyed (the driver releases it when it completes).
        let _ = guard("cuEventDestroy", || unsafe {
            let _ = result::ctx::set_current(self.device.ctx);
            result::event::destroy(self.event)
        });
    }
}

impl Cuda {
    pub(super) fn record(
        &self,
        d: &Arc<Device>,
        stream: sys::CUstream,
    ) -> Result<Box<dyn CopyTicket>> {
        let spare = d
            .spare_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let event = match spare {
            Some(e) => e,
            // Created with the device's context current.
            None => call("cuEventCreate", || {
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            })?,
        };
        let ticket = EventTicket {
            event,
            device: Arc::clone(d),
        };
        // SAFETY: event and stream belong to the current context.
        call("cuEventRecord", || unsafe {
            result::event::record(event, stream)
        })?;
        Ok(Box::new(ticket))
    }
}
