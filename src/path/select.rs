//! Which path a (registration, target) pair takes: the policy of `vram_path` and `dram_dmabuf`,
//! trying paths in order and binding the first that works, with the reason for the log.

use std::sync::Arc;

use super::cufile::Cufile;
use super::direct::Direct;
use super::dmabuf::Dmabuf;
use super::route::{Path, Route};
use crate::error::{Error, ErrorKind, Result};
use crate::gpu::cufile;
use crate::mem::{FileRegion, Registration};
use crate::params::{DramDmabuf, EngineParams, VramPath};
use crate::uring::dmabuf_uapi::DmabufSupport;
use crate::uring::Ring;

/// What choosing needs from the engine.
pub struct Selector<'a> {
    pub ring: &'a Arc<Ring>,
    pub params: &'a EngineParams,
    pub dmabuf_support: &'a DmabufSupport,
}

impl Selector<'_> {
    fn dmabuf(&self) -> Dmabuf<'_> {
        Dmabuf {
            ring: self.ring,
            support: self.dmabuf_support,
            verify: self.params.verify_dma,
        }
    }

    /// Binds the pair on the path the parameters pick and says why.
    pub fn choose(&self, mem: &Registration, file: &FileRegion) -> Result<(Route, String)> {
        match mem {
            Registration::Vram(_) => self.choose_vram(mem, file),
            Registration::Dram(d) if d.dmabuf.is_some() => self.choose_dram(mem, file),
            Registration::Dram(_) => Direct.bind(mem, file).map(|r| (r, "host memory".into())),
            Registration::Storage(_) => {
                Err(Error::invalid("a storage registration on the memory side"))
            }
        }
    }

    fn choose_vram(&self, mem: &Registration, file: &FileRegion) -> Result<(Route, String)> {
        let cufile_path = Cufile {
            api: self.params.cufile_api,
        };
        match self.params.vram_path {
            VramPath::Staging => Ok((Route::Staging, "vram_path=staging".into())),
            VramPath::Dmabuf => self
                .dmabuf()
                .bind(mem, file)
                .map(|r| (r, "vram_path=dmabuf".into()))
                .map_err(|why| {
                    Error::new(
                        ErrorKind::NotSupported,
                        format!("vram_path=dmabuf cannot reach fd {}: {why}", file.fd),
                    )
                    .caused_by(why)
                }),
            VramPath::Cufile => {
                let mode = cufile::mode().1;
                cufile_path
                    .bind(mem, file)
                    .map(|r| (r, format!("vram_path=cufile, mode {mode}")))
                    .map_err(|why| {
                        Error::new(
                            ErrorKind::NotSupported,
                            format!("vram_path=cufile cannot reach fd {}: {why}", file.fd),
                        )
                        .caused_by(why)
                    })
            }
            VramPath::Auto => match self.dmabuf().bind(mem, file) {
                Ok(r) => Ok((r, "auto: DMA-BUF registration and self-test passed".into())),
                Err(dmabuf_why) => match cufile::mode() {
                    (true, mode) => match cufile_path.bind(mem, file) {
                        Ok(r) => Ok((
                            r,
                            format!(
                                "auto: dmabuf unavailable ({dmabuf_why}); cuFile in mode {mode}"
                            ),
                        )),
                        Err(why) => Ok((
                            Route::Staging,
                            format!(
                                "auto: dmabuf unavailable ({dmabuf_why}); cuFile failed ({why}); \
                                 staging"
                            ),
                        )),
                    },
                    (false, mode) => Ok((
                        Route::Staging,
                        format!(
                            "auto: dmabuf unavailable ({dmabuf_why}); cuFile not direct here \
                             ({mode}); staging"
                        ),
                    )),
                },
            },
        }
    }

    fn choose_dram(&self, mem: &Registration, file: &FileRegion) -> Result<(Route, String)> {
        let (start, end) = mem.range();
        match (self.dmabuf().bind(mem, file), self.params.dram_dmabuf) {
            (Ok(r), _) => Ok((
                r,
                format!(
                    "dram_dmabuf: udmabuf registered, self-test {}",
                    if self.params.verify_dma {
                        "passed"
                    } else {
                        "off"
                    }
                ),
            )),
            (Err(why), DramDmabuf::On) => Err(Error::new(
                ErrorKind::NotSupported,
                format!(
                    "dram_dmabuf=on cannot reach fd {} from DRAM 0x{:x}+{}: {why}",
                    file.fd,
                    start,
                    end - start
                ),
            )
            .caused_by(why)),
            (Err(why), _) => Ok((
                Route::Host,
                format!("dram_dmabuf=auto: {why}; fixed buffers"),
            )),
        }
    }
}
