//! Binding a (memory registration, target file) pair's route on first use, for the planner: the
//! path layer's route cache and selector choose, bind and log it; what the route needs once per
//! engine is readied here (the driver's staging pool, the cuFile executor), so the first
//! transfer of the pair pays for neither.

use std::sync::Arc;

use once_cell::sync::OnceCell;

use super::driver::Driver;
use crate::error::Result;
use crate::mem::{FileRegion, Registration};
use crate::params::EngineParams;
use crate::path::cufile_exec::CufileExecutor;
use crate::path::routes::RouteCache;
use crate::path::select::Selector;
use crate::path::staging::StagingShape;
use crate::path::{cufile, Route};

/// What binding a pair needs from the engine.
pub struct Binder<'a> {
    pub routes: &'a RouteCache,
    pub selector: Selector<'a>,
    pub driver: &'a Driver,
    /// The engine's cuFile executor, started by the first pair on the cuFile route.
    pub cufile: &'a OnceCell<CufileExecutor>,
}

impl Binder<'_> {
    /// The pair's route: cached, or chosen, bound and readied now.
    pub fn route(&self, mem: &Registration, file: &FileRegion) -> Result<Route> {
        self.routes.route(&self.selector, mem, file, |route| {
            match (route, mem) {
                (Route::Staging, Registration::Vram(v)) => self.driver.enable_staging(
                    Arc::clone(&v.provider),
                    StagingShape::from_params(self.selector.params),
                )?,
                (Route::Cufile, _) => {
                    cufile_executor(self.cufile, self.selector.params);
                }
                _ => {}
            }
            Ok(())
        })
    }
}

/// The engine's cuFile executor, started on first use.
pub fn cufile_executor<'c>(
    cell: &'c OnceCell<CufileExecutor>,
    params: &EngineParams,
) -> &'c CufileExecutor {
    cell.get_or_init(|| cufile::executor(params.cufile_api, params.cufile_threads))
}
