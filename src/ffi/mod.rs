//! The NIXL-facing layer: everything NIXL loads, calls or reads, and the plugin's only
//! `extern "C"` code.
//!
//! - here: NIXL's two entry points and the function table the C++ shim calls (`iud_rust_api`),
//!   each body behind [`boundary`];
//! - `shim/` (C++, built by build.rs): the class NIXL instantiates, forwarding every call through
//!   the flat C bridge `shim/bridge.h`, seen from Rust as [`bridge`];
//! - [`handle`]: ownership across the boundary: every engine and request pointer, config, list
//!   and out-pointer the shim hands in goes through it (null-checked, typed); MDs stay opaque;
//! - [`manifest`]: the plugin's name, version, memory kinds and parameters, generated from
//!   plugin-manifest/; [`alias`]: serving under another backend's name; [`nixl_release`]: which
//!   NIXL release loaded the plugin, and whether it serves it;
//! - [`vulkan_alloc`]: the Vulkan allocator's C API, the plugin's other exported symbols.
//!
//! [`bridge`] and [`manifest`] are declarations every layer reads (the descriptor type, the
//! parameter table); they import nothing (tests/architecture.rs, `SHARED`).
//!
//! Every function body runs inside [`boundary`]: an error is logged once and mapped to its
//! status; a panic is caught, logged, and becomes NIXL_ERR_BACKEND.

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use once_cell::sync::Lazy;

use crate::engine::{Engine, Request};
use crate::error::{panic_message, status, Result};
use crate::log;
use crate::uring::Progress;
use bridge::{
    iud_desc_list, iud_engine_config, iud_file_info, iud_param_default, iud_reg_desc, iud_rust_api,
    iud_shim_plugin, iud_str,
};
use handle::{arg, check_out, write_out, Handle};

pub mod alias;
pub mod bridge;
pub mod handle;
pub mod manifest;
pub mod nixl_release;
pub mod vulkan_alloc;

/// Runs `body`, turning errors and panics into a status and one log line.
fn boundary(what: &str, body: impl FnOnce() -> Result<i32>) -> i32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => {
            // Messages that already name the call are logged as they are.
            if e.message.starts_with(what) {
                tracing::error!("{e}");
            } else {
                tracing::error!("{what}: {e}");
            }
            e.to_status()
        }
        Err(panic) => {
            let msg = panic_message(&*panic).unwrap_or_else(|| "unknown panic".into());
            tracing::error!("{what}: internal error ({msg}); please report this as a bug");
            status::ERR_BACKEND
        }
    }
}

fn progress_status(p: Progress) -> i32 {
    match p {
        Progress::Done => status::SUCCESS,
        Progress::InFlight => status::IN_PROG,
    }
}

unsafe extern "C" fn engine_create(
    config: *const iud_engine_config,
    engine_out: *mut *mut c_void,
) -> i32 {
    boundary("create_backend", || {
        // SAFETY: the shim passes a config that is valid for this call.
        let cfg = unsafe { arg(config, "engine config") }?;
        // SAFETY: the strings and the params array live for the duration of this call.
        let agent = unsafe { cfg.local_agent.as_string() };
        let pairs: Vec<(String, String)> = if cfg.params.is_null() {
            Vec::new()
        } else {
            // SAFETY: params/param_count describe the shim's vector, valid during the call.
            unsafe { std::slice::from_raw_parts(cfg.params, cfg.param_count as usize) }
                .iter()
                // SAFETY: each key/value view points into the agent's params map.
                .map(|kv| unsafe {
                    (
                        kv.key.as_string().into_owned(),
                        kv.value.as_string().into_owned(),
                    )
                })
                .collect()
        };
        tracing::debug!(
            sync_mode = cfg.sync_mode,
            enable_prog_thread = cfg.enable_prog_thread,
            "create_backend"
        );
        // SAFETY: the type string lives for the duration of this call.
        let served = unsafe { cfg.backend_type.as_string() };
        alias::announce(&served);
        let pairs = alias::translate(&served, pairs);
        let engine = Engine::new(&agent, pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
        let raw = Engine::into_raw(Box::new(engine));
        // SAFETY: engine_out is a valid out-pointer from the shim.
        if let Err(e) = unsafe { write_out(engine_out, raw, "engine_out") } {
            // SAFETY: raw was made just above and never handed out.
            drop(unsafe { Engine::try_take(raw) });
            return Err(e);
        }
        Ok(status::SUCCESS)
    })
}

unsafe extern "C" fn engine_destroy(engine: *mut c_void) {
    boundary("destroy_engine", || {
        // SAFETY: the shim calls this once, with the pointer engine_create returned; NULL (no
        // engine was made) has nothing to free.
        if let Ok(engine) = unsafe { Engine::try_take(engine) } {
            drop(engine);
        }
        Ok(status::SUCCESS)
    });
}

unsafe extern "C" fn register_mem(
    engine: *mut c_void,
    desc: *const iud_reg_desc,
    mem_kind: i32,
    md_out: *mut *mut c_void,
) -> i32 {
    boundary("registerMem", || {
        // SAFETY: engine and desc are valid for the call (shim contract).
        let (engine, d) = unsafe {
            (
                Engine::try_ref(engine)?,
                arg(desc, "registration descriptor")?,
            )
        };
        // SAFETY: meta_info points into the agent's descriptor for the duration of the call.
        let meta = unsafe { d.meta_info.as_string() };
        // Before registering: a registration made for nowhere would have to be undone.
        check_out(md_out, "md_out")?;
        let md = engine.register(mem_kind, d.addr, d.len, d.dev_id, &meta)?;
        // SAFETY: md_out is a valid out-pointer from the shim (non-null, checked above).
        unsafe { write_out(md_out, md as *mut c_void, "md_out") }?;
        Ok(status::SUCCESS)
    })
}

unsafe extern "C" fn deregister_mem(engine: *mut c_void, md: *mut c_void) -> i32 {
    boundary("deregisterMem", || {
        // SAFETY: engine is live. md is an opaque token the engine looks up, never dereferences.
        unsafe { Engine::try_ref(engine)? }.deregister(md)?;
        Ok(status::SUCCESS)
    })
}

unsafe extern "C" fn prep_xfer(
    engine: *mut c_void,
    op: i32,
    local: *const iud_desc_list,
    remote: *const iud_desc_list,
    remote_agent: iud_str,
    req_out: *mut *mut c_void,
) -> i32 {
    boundary("prepXfer", || {
        // SAFETY: the lists point at the agent's descriptor vectors, valid during the call (their
        // MDs are opaque tokens the engine looks up, never dereferences).
        let (engine, l, r) = unsafe {
            (
                Engine::try_ref(engine)?,
                arg(local, "local list")?,
                arg(remote, "remote list")?,
            )
        };
        check_out(req_out, "req_out")?;
        // SAFETY: as above: the lists' descriptor arrays and the agent name, valid for the call.
        let (ld, rd, agent) = unsafe { (l.as_slice(), r.as_slice(), remote_agent.as_string()) };
        let req = engine.prep(op, l.mem_kind, ld, r.mem_kind, rd, &agent)?;
        // SAFETY: req_out is a valid out-pointer (non-null, checked above); written only on success.
        unsafe { write_out(req_out, Request::into_raw(req), "req_out") }?;
        Ok(status::SUCCESS)
    })
}

unsafe extern "C" fn post_xfer(
    engine: *mut c_void,
    req: *mut c_void,
    op: i32,
    local: *const iud_desc_list,
    remote: *const iud_desc_list,
) -> i32 {
    boundary("postXfer", || {
        // SAFETY: req was returned by prep_xfer and not released; lists are valid for the call.
        let (engine, req, l, r) = unsafe {
            (
                Engine::try_ref(engine)?,
                Request::try_ref(req)?,
                arg(local, "local list")?,
                arg(remote, "remote list")?,
            )
        };
        engine
            .post(req, op, l.count as usize, r.count as usize)
            .map(progress_status)
    })
}

unsafe extern "C" fn check_xfer(engine: *mut c_void, req: *mut c_void) -> i32 {
    boundary("checkXfer", || {
        // SAFETY: req was returned by prep_xfer and not released.
        let (engine, req) = unsafe { (Engine::try_ref(engine)?, Request::try_ref(req)?) };
        engine.check(req).map(progress_status)
    })
}

unsafe extern "C" fn release_req(engine: *mut c_void, req: *mut c_void) -> i32 {
    boundary("releaseReqH", || {
        // SAFETY: req was returned by prep_xfer; the shim calls this once per handle (again only
        // after an error, when we handed ownership back by leaking the Box).
        let engine = unsafe { Engine::try_ref(engine) }?;
        // SAFETY: as above.
        let req = unsafe { Request::try_take(req) }?;
        match engine.release(req) {
            Ok(()) => Ok(status::SUCCESS),
            Err((req, e)) => {
                // NIXL keeps the request after an error: hand the same allocation back to it.
                let _ = Request::into_raw(req);
                Err(e)
            }
        }
    })
}

unsafe extern "C" fn log_error(message: *const c_char) {
    if message.is_null() {
        return;
    }
    // SAFETY: the shim passes a NUL-terminated string valid for the call.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy();
    tracing::error!("{text}");
}

unsafe extern "C" fn engine_mems(backend_type: iud_str, mems_out: *mut *const i32) -> u32 {
    catch_unwind(|| {
        // SAFETY: the shim passes a view valid for the call and a valid out-pointer.
        let mems = alias::mems_for(&unsafe { backend_type.as_string() });
        // SAFETY: as above; the slice is 'static.
        unsafe { *mems_out = mems.as_ptr() };
        mems.len() as u32
    })
    .unwrap_or(0)
}

unsafe extern "C" fn query_file(meta_info: iud_str, info_out: *mut iud_file_info) -> i32 {
    boundary("queryMem", || {
        // SAFETY: the view is valid for the call.
        let meta = unsafe { meta_info.as_string() };
        Ok(match crate::mem::file_query::query(&meta) {
            Some(i) => {
                // SAFETY: info_out is a valid out-pointer from the shim.
                unsafe {
                    *info_out = iud_file_info {
                        size: i.size,
                        mode: i.mode,
                        mtime: i.mtime,
                    }
                };
                1
            }
            None => 0,
        })
    })
}

/// The function table and the static data it points to.
struct ApiTable {
    api: iud_rust_api,
    _params: Vec<iud_param_default>,
}

// SAFETY: the table only holds pointers to 'static data (manifest strings, the params vector
// owned by the table itself, which is never mutated) and function pointers.
unsafe impl Sync for ApiTable {}
// SAFETY: as above.
unsafe impl Send for ApiTable {}

static API: Lazy<ApiTable> = Lazy::new(|| {
    let params: Vec<iud_param_default> = manifest::PARAMS
        .iter()
        .map(|p| iud_param_default {
            name: p.name_c.as_ptr(),
            default_value: p.default_c.as_ptr(),
        })
        .collect();
    let api = iud_rust_api {
        plugin_name: manifest::PLUGIN_NAME_C.as_ptr(),
        plugin_version: manifest::PLUGIN_VERSION_C.as_ptr(),
        // Before any engine exists, NIXL asks the library (get_plugin_mems): answer for the name
        // its file has (alias.rs).
        mems: alias::mems_for(alias::library_name()).as_ptr(),
        mem_count: alias::mems_for(alias::library_name()).len() as u32,
        params: params.as_ptr(),
        param_count: params.len() as u32,
        engine_create: Some(engine_create),
        engine_destroy: Some(engine_destroy),
        register_mem: Some(register_mem),
        deregister_mem: Some(deregister_mem),
        prep_xfer: Some(prep_xfer),
        post_xfer: Some(post_xfer),
        check_xfer: Some(check_xfer),
        release_req: Some(release_req),
        log_error: Some(log_error),
        engine_mems: Some(engine_mems),
        query_file: Some(query_file),
    };
    ApiTable {
        api,
        _params: params,
    }
});

/// NIXL's plugin entry point: returns the process-wide `nixlBackendPlugin`. Idempotent (NIXL
/// calls init/fini repeatedly, e.g. around `getPluginParams`).
#[no_mangle]
pub extern "C" fn nixl_plugin_init() -> *mut c_void {
    catch_unwind(|| {
        log::init();
        // A NIXL release line whose plugin ABI is not the one nixl-headers/ declares gets no
        // plugin struct (one error line says why): nixl_release.rs.
        if !nixl_release::admit() {
            return ptr::null_mut();
        }
        // SAFETY: API is a 'static table that outlives every use the shim makes of it.
        unsafe { iud_shim_plugin(&API.api) }
    })
    .unwrap_or(ptr::null_mut())
}

/// NIXL's plugin exit point. The plugin struct and its table are process-lifetime statics
/// (NIXL dlopens with RTLD_NODELETE and may call init again), so there is nothing to free.
#[no_mangle]
pub extern "C" fn nixl_plugin_fini() {}
