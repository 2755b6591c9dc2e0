//! The one run-time library loader of the vendor layer (cuFile, HSA), over `libloading`.
//!
//! A library is opened with `RTLD_NOW | RTLD_LOCAL` (every symbol bound at once, none leaked into
//! the global namespace) and never closed: vendor runtimes keep process-wide state (threads, the
//! KFD fd, cuFile's driver) that outlives any handle, and `dlclose` would run their destructors
//! under it. So the function pointers resolved here stay valid for the whole process.
//!
//! A symbol resolves only to an `unsafe extern "C" fn` type (`CFunction`): holding one is safe,
//! calling it needs `unsafe` at the call site, whose SAFETY note says the type spells the C
//! signature of the header. A missing library or symbol is an error naming both, never a panic.

use std::mem::ManuallyDrop;

use libloading::os::unix::{Library as RawLibrary, RTLD_LOCAL, RTLD_NOW};

use crate::error::{Error, ErrorKind, Result};

mod sealed {
    pub trait Sealed {}
}

/// A C function pointer type (`unsafe extern "C" fn(..) -> R`): the only kind of value a symbol
/// resolves to, so a resolved address can only be used through an `unsafe` call.
pub trait CFunction: Copy + sealed::Sealed {}

macro_rules! c_function {
    ($($arg:ident),*) => {
        impl<R, $($arg),*> sealed::Sealed for unsafe extern "C" fn($($arg),*) -> R {}
        impl<R, $($arg),*> CFunction for unsafe extern "C" fn($($arg),*) -> R {}
    };
}
c_function!();
c_function!(A);
c_function!(A, B);
c_function!(A, B, C);
c_function!(A, B, C, D);
c_function!(A, B, C, D, E);
c_function!(A, B, C, D, E, F);
c_function!(A, B, C, D, E, F, G);
c_function!(A, B, C, D, E, F, G, H);

/// An opened library (never closed, see the module note) and the name it was opened by.
pub struct Library {
    raw: ManuallyDrop<RawLibrary>,
    name: String,
}

/// The loader's own text for a libloading error: dlerror's description when there is one.
fn describe(e: &libloading::Error) -> String {
    std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string())
}

impl Library {
    /// Opens `name` (a soname or a path). Err: NotSupported, "`name` could not be loaded: dlerror".
    pub fn open(name: &str) -> Result<Library> {
        if name.contains('\0') {
            return Err(Error::invalid(format!(
                "library name {name:?} contains a NUL byte"
            )));
        }
        // SAFETY: loading a vendor library runs its initialisers; these are the libraries the
        // plugin exists to drive, loaded exactly as their own documentation says (dlopen).
        match unsafe { RawLibrary::open(Some(name), RTLD_NOW | RTLD_LOCAL) } {
            Ok(raw) => Ok(Library {
                raw: ManuallyDrop::new(raw),
                name: name.to_owned(),
            }),
            Err(e) => Err(Error::new(
                ErrorKind::NotSupported,
                format!("{name} could not be loaded: {}", describe(&e)),
            )),
        }
    }

    /// The name or path the library was opened by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Resolves `symbol` as the C function type `F`. Err: NotSupported, "`name` lacks `symbol`".
    pub fn symbol<F: CFunction>(&self, symbol: &str) -> Result<F> {
        self.optional(symbol).ok_or_else(|| {
            Error::new(
                ErrorKind::NotSupported,
                format!("{} lacks {symbol}", self.name),
            )
        })
    }

    /// Resolves `symbol` as `F`, or None when the library does not export it.
    pub fn optional<F: CFunction>(&self, symbol: &str) -> Option<F> {
        // SAFETY: F is a function pointer type (sealed `CFunction`), pointer-sized (libloading
        // checks) and never null (libloading returns Err for a null address), so the value is a
        // valid F; calling it is unsafe and left to the caller. The library is never closed, so
        // the copied pointer stays valid after the `Symbol` goes.
        unsafe { self.raw.get::<F>(symbol) }.ok().map(|s| *s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let e = Library::open("/nonexistent/libnothing.so.1")
            .err()
            .expect("no such library");
        assert_eq!(e.kind, ErrorKind::NotSupported);
        assert!(
            e.message
                .starts_with("/nonexistent/libnothing.so.1 could not be loaded: "),
            "{}",
            e.message
        );
        assert!(
            e.message.contains("No such file"),
            "dlerror text: {}",
            e.message
        );
    }

    #[test]
    fn symbols_resolve_typed_and_a_missing_one_is_named() {
        let lib = Library::open("libc.so.6").unwrap();
        let getpid: unsafe extern "C" fn() -> i32 = lib.symbol("getpid").unwrap();
        // SAFETY: getpid() -> pid_t (int) in unistd.h.
        assert_eq!(unsafe { getpid() } as u32, std::process::id());
        let e = lib
            .symbol::<unsafe extern "C" fn()>("no_such_symbol_here")
            .err()
            .unwrap();
        assert_eq!(e.kind, ErrorKind::NotSupported);
        assert_eq!(e.message, "libc.so.6 lacks no_such_symbol_here");
        assert!(lib
            .optional::<unsafe extern "C" fn()>("no_such_symbol_here")
            .is_none());
        assert!(Library::open("bad\0name").is_err());
    }
}
