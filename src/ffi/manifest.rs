//! The backend's identity, memory kinds and parameters, generated from
//! `plugin-manifest/IO_URING_DMABUF.toml` by build.rs. This is the single source for
//! `get_backend_options`, `get_backend_mems`, the parameter parser and the table in
//! docs/parameters.md.

use std::ffi::CStr;

/// One backend parameter as declared in the manifest.
#[derive(Debug)]
pub struct ParamSpec {
    pub name: &'static str,
    pub name_c: &'static CStr,
    pub default: &'static str,
    pub default_c: &'static CStr,
    pub doc: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/manifest.rs"));

/// The manifest entry for `name`, if the backend knows that parameter.
pub fn param(name: &str) -> Option<&'static ParamSpec> {
    PARAMS.iter().find(|p| p.name == name)
}
