//! The route cache: for each (memory registration, target file) pair the route chosen and bound
//! on first use, one binding at a time, logged once with its reason, and forgotten when NIXL
//! deregisters the memory or the file.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use super::route::Route;
use super::select::Selector;
use crate::error::{Error, Failure, Result};
use crate::mem::{FileRegion, Registration};
use crate::uring::FileKey;

/// The routes of one engine's pairs.
pub struct RouteCache {
    /// Set when one of the cache's locks is found poisoned.
    failure: Arc<Failure>,
    /// Keyed by the registration's address (its MD) and the file.
    routes: Mutex<HashMap<(usize, FileKey), Route>>,
    /// Held while a pair is bound, so that requests prepared at once on a new pair bind it once.
    binding: Mutex<()>,
    /// Routes (with their reason) already logged at info level.
    logged: Mutex<HashSet<String>>,
}

impl RouteCache {
    pub fn new(failure: Arc<Failure>) -> RouteCache {
        RouteCache {
            failure,
            routes: Mutex::new(HashMap::new()),
            binding: Mutex::new(()),
            logged: Mutex::new(HashSet::new()),
        }
    }

    /// How a memory registration reaches `file`: cached, or chosen and bound by `selector`,
    /// then readied by `ready` (the one-time work a route needs above this layer: the staging
    /// pool, the cuFile executor; `xfer::bind`), cached and logged once with the reason.
    pub fn route(
        &self,
        selector: &Selector<'_>,
        mem: &Registration,
        file: &FileRegion,
        ready: impl FnOnce(&Route) -> Result<()>,
    ) -> Result<Route> {
        if let Registration::Dram(d) = mem {
            if d.dmabuf.is_none() {
                return Ok(Route::Host);
            }
        }
        let key = (mem as *const Registration as usize, file.key());
        let cached = || {
            self.failure
                .lock(&self.routes, "route cache")
                .map(|routes| routes.get(&key).cloned())
        };
        if let Some(r) = cached()? {
            return Ok(r);
        }
        // One binding at a time, and the cache asked again under it: threads preparing requests
        // at once on a new pair would otherwise each bind it (two sets of DMA-BUF slots, cuFile
        // asked to register one fd twice). Pairs already bound never wait here.
        let _binding = self.failure.lock(&self.binding, "route binding")?;
        if let Some(r) = cached()? {
            return Ok(r);
        }
        let what = match mem {
            Registration::Vram(v) => format!("VRAM 0x{:x}+{} (GPU {})", v.addr, v.len, v.device),
            Registration::Dram(d) => format!("DRAM 0x{:x}+{}", d.addr, d.len),
            Registration::Storage(_) => {
                return Err(Error::invalid("a storage registration on the memory side"))
            }
        };
        let (route, reason) = selector.choose(mem, file)?;
        ready(&route)?;
        // Once per distinct route and reason at info: a client registering a file per key
        // would otherwise log a line per file.
        let described = format!("{} ({reason})", route.describe());
        if self
            .failure
            .lock(&self.logged, "route log")?
            .insert(described.clone())
        {
            tracing::info!("{what} <-> fd {}: {described}", file.fd);
        } else {
            tracing::debug!("{what} <-> fd {}: {described}", file.fd);
        }
        self.failure
            .lock(&self.routes, "route cache")?
            .insert(key, route.clone());
        Ok(route)
    }

    /// Forgets the routes of a deregistered registration: those of its memory (a later
    /// registration may reuse the address) and, for a file, every route to it.
    pub fn forget(&self, reg: &Arc<Registration>) -> Result<()> {
        let file = match &**reg {
            Registration::Storage(f) => Some(f.key()),
            _ => None,
        };
        let mem = Arc::as_ptr(reg) as usize;
        self.failure
            .lock(&self.routes, "route cache")?
            .retain(|(m, k), _| *m != mem && Some(*k) != file);
        Ok(())
    }

    /// How many pairs have a route.
    pub fn count(&self) -> Result<usize> {
        Ok(self.failure.lock(&self.routes, "route cache")?.len())
    }

    /// Poisons the cache's lock (tests of the failed state).
    #[cfg(test)]
    pub fn poison(&self) {
        crate::error::poison(&self.routes);
    }
}
