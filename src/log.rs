//! Logging: one tracing subscriber for the plugin, writing to stderr.
//!
//! The plugin is a cdylib with its own copy of `tracing`, so its global subscriber cannot clash
//! with a host application's. The level comes from `IO_URING_DMABUF_LOG` or else NIXL's own
//! `NIXL_LOG_LEVEL` (TRACE/DEBUG/INFO/WARN/ERROR); the default is WARN, so every failure's one
//! error line is visible while the data path stays silent.

use once_cell::sync::OnceCell;
use tracing::Level;

static INIT: OnceCell<()> = OnceCell::new();

/// Installs the subscriber once per process; later calls do nothing.
pub fn init() {
    INIT.get_or_init(|| {
        let level = ["IO_URING_DMABUF_LOG", "NIXL_LOG_LEVEL"]
            .iter()
            .find_map(|var| std::env::var(var).ok().and_then(|v| parse_level(&v)))
            .unwrap_or(Level::WARN);
        // try_init: if something else already set a global subscriber in this copy of tracing
        // (only possible in tests), keep it.
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(level)
            .with_target(true)
            .try_init();
    });
}

fn parse_level(text: &str) -> Option<Level> {
    match text.trim().to_ascii_uppercase().as_str() {
        "TRACE" => Some(Level::TRACE),
        "DEBUG" => Some(Level::DEBUG),
        "INFO" => Some(Level::INFO),
        "WARN" | "WARNING" => Some(Level::WARN),
        "ERROR" | "FATAL" => Some(Level::ERROR),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nixl_level_names_are_understood() {
        assert_eq!(parse_level("debug"), Some(Level::DEBUG));
        assert_eq!(parse_level(" WARN "), Some(Level::WARN));
        assert_eq!(parse_level("fatal"), Some(Level::ERROR));
        assert_eq!(parse_level("loud"), None);
    }
}
