//! Build script: compiles the C++ shim against nixl-headers/, generates the Rust view of the flat
//! C bridge with bindgen, and turns plugin-manifest/IO_URING_DMABUF.toml into Rust tables.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

const MANIFEST: &str = "plugin-manifest/IO_URING_DMABUF.toml";

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    compile_shim();
    generate_bridge(&out);
    generate_manifest(&out);
}

fn compile_shim() {
    for f in [
        "src/ffi/shim/engine.cpp",
        "src/ffi/shim/bridge.h",
        "nixl-headers/nixl_abi.h",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    // Same C++ ABI as the NIXL wheel: C++20, new string ABI, dynamic libstdc++ (cc links
    // libstdc++ dynamically for cpp(true)); hidden visibility so no inline or template
    // instantiation of ours can interpose libnixl's or be interposed.
    cc::Build::new()
        .cpp(true)
        .file("src/ffi/shim/engine.cpp")
        .include("nixl-headers")
        .include("src/ffi/shim")
        .std("c++20")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .flag("-fvisibility=hidden")
        .flag("-fvisibility-inlines-hidden")
        .flag("-Wall")
        .flag("-Wextra")
        .flag("-Werror")
        .compile("iud_shim");
}

fn generate_bridge(out: &Path) {
    let bindings = bindgen::Builder::default()
        .header("src/ffi/shim/bridge.h")
        .allowlist_type("iud_.*")
        .allowlist_function("iud_shim_plugin")
        .derive_default(true)
        .layout_tests(true)
        .generate()
        .expect("bindgen over src/ffi/shim/bridge.h");
    bindings
        .write_to_file(out.join("bridge.rs"))
        .expect("write bridge.rs");
}

/// nixl_mem_t numbers (nixl-headers/nixl_abi.h).
fn mem_number(name: &str) -> i32 {
    match name {
        "DRAM_SEG" => 0,
        "VRAM_SEG" => 1,
        "BLK_SEG" => 2,
        "OBJ_SEG" => 3,
        "FILE_SEG" => 4,
        other => panic!("{MANIFEST}: unknown memory kind {other}"),
    }
}

fn generate_manifest(out: &Path) {
    println!("cargo:rerun-if-changed={MANIFEST}");
    let text = fs::read_to_string(MANIFEST).expect("read plugin manifest");
    let doc: toml::Table = text.parse().expect("plugin manifest is valid TOML");
    let plugin = doc["plugin"].as_table().expect("[plugin] table");
    let s = |t: &toml::Table, k: &str| -> String {
        t.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_else(|| panic!("{MANIFEST}: missing {k}"))
            .to_owned()
    };
    let mut code = String::new();
    let name = s(plugin, "name");
    let version = s(plugin, "version");
    writeln!(code, "pub const PLUGIN_NAME: &str = {name:?};").unwrap();
    writeln!(
        code,
        "pub const PLUGIN_NAME_C: &std::ffi::CStr = c{name:?};"
    )
    .unwrap();
    writeln!(
        code,
        "pub const PLUGIN_VERSION_C: &std::ffi::CStr = c{version:?};"
    )
    .unwrap();
    let api = plugin["plugin_api_version"]
        .as_integer()
        .expect("plugin_api_version");
    writeln!(code, "pub const PLUGIN_API_VERSION: i32 = {api};").unwrap();
    let strings = |k: &str| -> Vec<String> {
        plugin[k]
            .as_array()
            .unwrap_or_else(|| panic!("{MANIFEST}: {k} is not a list"))
            .iter()
            .map(|v| {
                v.as_str()
                    .unwrap_or_else(|| panic!("{MANIFEST}: {k} holds a non-string"))
                    .to_owned()
            })
            .collect()
    };
    let tested = strings("nixl_versions_tested");
    let lines = strings("nixl_abi_lines");
    for v in &tested {
        let line = v.splitn(3, '.').take(2).collect::<Vec<_>>().join(".");
        assert!(
            lines.contains(&line),
            "{MANIFEST}: tested release {v} is not of an nixl_abi_lines line"
        );
    }
    writeln!(
        code,
        "pub static NIXL_VERSIONS_TESTED: [&str; {}] = {tested:?};",
        tested.len()
    )
    .unwrap();
    writeln!(
        code,
        "pub static NIXL_ABI_LINES: [&str; {}] = {lines:?};",
        lines.len()
    )
    .unwrap();
    let mems: Vec<i32> = plugin["mems"]
        .as_array()
        .expect("mems")
        .iter()
        .map(|m| mem_number(m.as_str().expect("mem name")))
        .collect();
    writeln!(code, "pub static MEMS: [i32; {}] = {mems:?};", mems.len()).unwrap();
    let params = doc["param"].as_array().expect("[[param]] entries");
    writeln!(code, "pub static PARAMS: [ParamSpec; {}] = [", params.len()).unwrap();
    for p in params {
        let p = p.as_table().expect("param table");
        writeln!(
            code,
            "    ParamSpec {{ name: {:?}, name_c: c{:?}, default: {:?}, default_c: c{:?}, doc: {:?} }},",
            s(p, "name"),
            s(p, "name"),
            s(p, "default"),
            s(p, "default"),
            s(p, "doc")
        )
        .unwrap();
    }
    writeln!(code, "];").unwrap();
    fs::write(out.join("manifest.rs"), code).expect("write manifest.rs");
}
