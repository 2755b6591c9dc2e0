#!/usr/bin/env python3
"""Reads NIXL's backend-plugin ABI out of a NIXL wheel's binaries and checks it against the
numbers nixl-headers/nixl_abi.h freezes, and against the built plugin's own binary.

    ci/nixl_abi_probe.py WHEEL_LIBS [--plugin LIB.so] [--facts]

WHEEL_LIBS is the wheel's `.nixl_cu1X.mesonpy.libs` folder. Only binutils (readelf, objdump,
c++filt) and the standard library are used; nothing is loaded or run. What is read, and where:

  version       libnixl_common.so: the string after "NIXL version: " (nixl_log.cpp logs it)
  api_version   libnixl.so backendLoader: the immediate its `cmpl $N,(%rax)` compares
                nixlBackendPlugin::api_version with
  plugin struct libnixl.so nixlBackendPluginHandle::{createEngine,...}: the offset each reads
                its function pointer from
  initErr       libnixl.so nixlAgent::createBackend: the offset of its `cmpb $0x0,N(%rax)`
  vtable        the relocations of libplugin_POSIX.so's (and GDS_MT's) engine vtable, demangled,
                class names removed; the plugin's ShimEngine vtable read the same way
  base class    the inlined nixlBackendEngine constructor at the top of POSIX's (and the
                plugin's) engine constructor: offsets read from the init params and written to
                the engine before the derived class's vptr is stored
  descriptors   libnixl_build.so nixlDescList<T>::descCount/getType: element size (the shift
                and the multiplicative inverse of the division) and the list's field offsets

Exit status 0 when every check holds, 1 otherwise; each check prints one line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# The numbers nixl-headers/nixl_abi.h static_asserts (x86-64), by the name the header uses.
PLUGIN_API_VERSION = 1
PLUGIN_STRUCT = {
    "create_engine": 8,
    "destroy_engine": 16,
    "get_plugin_name": 24,
    "get_plugin_version": 32,
    "get_backend_options": 40,
    "get_backend_mems": 48,
}
INIT_ERR = 0xA0
VTABLE_SLOTS = 27
# Init params fields the base constructor reads: localAgent (data, size), type (data, size),
# customParams, enableTelemetry_.
INIT_READS = {
    0x00: "localAgent",
    0x08: "localAgent.size",
    0x20: "type",
    0x28: "type.size",
    0x40: "customParams",
    0x5C: "enableTelemetry_",
}
# Engine fields the base constructor writes: backendType, customParams, telemetryEvents_,
# telemetryEventsMutex_, initErr, localAgent, enableTelemetry_; nothing at or past sizeof 208.
BASE_WRITES = {
    0x08: "backendType",
    0x28: "customParams",
    0x60: "telemetryEvents_",
    0x78: "telemetryEventsMutex_",
    0xA0: "initErr",
    0xA8: "localAgent",
    0xC8: "enableTelemetry_",
}
BASE_SIZE = 208
DESC_SIZES = {"nixlBasicDesc": 24, "nixlBlobDesc": 56, "nixlMetaDesc": 32, "nixlRemoteMetaDesc": 64}
LIST_TYPE, LIST_VECTOR = 8, 16

ENGINES = {  # plugin file -> engine vtable symbol, constructor symbol
    "libplugin_POSIX.so": (
        "_ZTV15nixlPosixEngine",
        "_ZN15nixlPosixEngineC2EPK21nixlBackendInitParams",
    ),
    "libplugin_GDS_MT.so": (
        "_ZTV15nixlGdsMtEngine",
        "_ZN15nixlGdsMtEngineC2EPK21nixlBackendInitParams",
    ),
}
SHIM = (
    "_ZTVN12_GLOBAL__N_110ShimEngineE",
    "_ZN12_GLOBAL__N_110ShimEngineC2EPK21nixlBackendInitParams",
)


def run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


class Elf:
    """Symbols and relocations of one shared library."""

    def __init__(self, path: str):
        self.path = path
        self.syms: dict[str, tuple[int, int]] = {}
        self.by_addr: dict[int, list[str]] = {}
        for line in run("readelf", "-Ws", "--wide", path).splitlines():
            f = line.split()
            if len(f) >= 8 and re.fullmatch(r"[0-9a-f]{16}", f[1]) and f[6] != "UND":
                name = f[7].split("@")[0]
                size = int(f[2], 16) if f[2].startswith("0x") else int(f[2])
                self.syms.setdefault(name, (int(f[1], 16), size))
                if f[3] == "FUNC":
                    self.by_addr.setdefault(int(f[1], 16), []).append(name)
        self.relocs: dict[int, tuple[str, object]] = {}
        for line in run("readelf", "-rW", path).splitlines():
            f = line.split()
            if len(f) >= 4 and re.fullmatch(r"[0-9a-f]{16}", f[0]):
                if f[2] == "R_X86_64_RELATIVE":
                    self.relocs[int(f[0], 16)] = ("addr", int(f[3], 16))
                elif f[2] in ("R_X86_64_64", "R_X86_64_GLOB_DAT") and len(f) >= 5:
                    self.relocs[int(f[0], 16)] = ("sym", f[4].split("@")[0])

    def find(self, pattern: str) -> str | None:
        return next((n for n in self.syms if re.fullmatch(pattern, n)), None)

    def disasm(self, name: str) -> list[str]:
        return [ins for ins, _ in self.disasm_with_targets(name)]

    def disasm_with_targets(self, name: str) -> list[tuple[str, int | None]]:
        """Instructions, each with the address a %rip-relative operand points at (or None)."""
        addr, size = self.syms[name]
        out = run(
            "objdump",
            "-d",
            "--no-show-raw-insn",
            f"--start-address={addr}",
            f"--stop-address={addr + size}",
            self.path,
        )
        res = []
        for ln in out.splitlines():
            if not re.match(r"\s+[0-9a-f]+:\t", ln):
                continue
            text, _, comment = ln.split("\t", 1)[1].partition("#")
            m = re.match(r"\s*([0-9a-f]+)", comment) if "(%rip)" in text else None
            res.append((text.strip(), int(m.group(1), 16) if m else None))
        return res

    def points_at(self, target: int | None, symbol: str) -> bool:
        """Whether a %rip-relative operand is `symbol`'s address (+16, the vtable's address
        point) or a GOT slot holding it."""
        if target is None:
            return False
        base = self.syms.get(symbol, (None, 0))[0]
        if base is not None and target in (base, base + 16):
            return True
        kind, val = self.relocs.get(target, ("none", None))
        return (kind == "sym" and val == symbol) or (kind == "addr" and val == base)

    def vtable(self, name: str) -> list[set[str]]:
        """Slot signatures from the address point on, class names removed. A slot is a set: the
        compiler gives functions with identical code one address (GCC's -fipa-icf), so every
        name at the slot's address is what the slot calls."""
        addr, size = self.syms[name]
        slots = []
        for off in range(16, size, 8):
            kind, val = self.relocs.get(addr + off, ("none", None))
            names = sorted(set(self.by_addr.get(val, [hex(val)]))) if kind == "addr" else [str(val)]
            slots.append({normalize(d) for d in run("c++filt", *names).splitlines()})
        return slots


def normalize(demangled: str) -> str:
    s = re.sub(r"^.*?::~\w+\(\)", "~()", demangled)  # both destructors (D1, D0)
    return re.sub(r"^(\(anonymous namespace\)::)?\w+::(?=\w+\()", "", s)


MEM = re.compile(r"(-?0x[0-9a-f]+)?\((%r\w+)\)")


def base_ctor(elf: Elf, ctor: str, vtable: str) -> tuple[set[int], set[int]]:
    """Offsets the inlined base constructor reads from init params and writes to the engine:
    a linear walk from the entry to the store of the derived class's vptr (`vtable`),
    following the registers that hold `this` (%rdi) and the init params (%rsi)."""
    this, init = {"%rdi"}, {"%rsi"}
    reads, writes = set(), set()
    derived_vptr = False
    for ins, target in elf.disasm_with_targets(ctor):
        op, _, args = ins.partition(" ")
        ops = [o.strip() for o in re.findall(r"[^,(]*\([^)]*\)|[^,]+", args.strip())]
        regs = [o for o in ops if re.fullmatch(r"%r\w+", o)]
        if op in ("mov", "lea") and ops[-1:] == ["%rax"] and elf.points_at(target, vtable):
            derived_vptr = True
        if op == "mov" and len(ops) == 2 and len(regs) == 2:
            src, dst = ops
            this.discard(dst), init.discard(dst)
            if src in this:
                this.add(dst)
            if src in init:
                init.add(dst)
            continue
        if (
            derived_vptr
            and op == "mov"
            and len(ops) == 2
            and ops[0] == "%rax"
            and ops[1] in {f"({r})" for r in this}
        ):
            break  # the derived class's vptr is stored: the base constructor is done
        for k, o in enumerate(ops):
            m = MEM.fullmatch(o)
            if not m:
                continue
            disp, reg = int(m.group(1) or "0", 16), m.group(2)
            is_dst = k == len(ops) - 1 and len(ops) > 1
            if reg in init and not is_dst and op != "lea":
                reads.add(disp)
            if reg in this and is_dst:
                writes.add(disp)
        if ops and re.fullmatch(r"%r\w+", ops[-1]) and not op.startswith(("cmp", "test", "push")):
            this.discard(ops[-1]), init.discard(ops[-1])
    return reads, writes


def version(libs: str) -> str:
    data = open(os.path.join(libs, "libnixl_common.so"), "rb").read()
    at = data.find(b"NIXL version: \0")
    if at < 0:
        return "unknown"
    tail = data[at + 15 : at + 64].split(b"\0")[0].decode(errors="replace")
    return tail if re.fullmatch(r"\d+\.\d+\.\d+\S*", tail) else "unknown"


def loaded_offset(ins: list[str]) -> int | None:
    """The offset of the function pointer an indirect call or jump through %rax goes to: the
    last `mov N(%rax),%rax` before the first `call *%rax` / `jmp *%rax`."""
    end = next((k for k, i in enumerate(ins) if re.fullmatch(r"(call|jmp)\s+\*%rax", i)), len(ins))
    loads = [
        int(m.group(1), 16)
        for i in ins[:end]
        if (m := re.fullmatch(r"mov\s+(0x[0-9a-f]+)\(%rax\),%rax", i))
    ]
    return loads[-1] if loads else None


def desc_size(ins: list[str]) -> int | None:
    """descCount() is (end - begin) / sizeof(T): `sar $k` alone, or `sar $k; imul $inv`."""
    shift = next(
        (int(m.group(1), 16) for i in ins if (m := re.fullmatch(r"sar\s+\$(0x[0-9a-f]+),%rax", i))),
        None,
    )
    inv = next(
        (
            int(m.group(1), 16)
            for i in ins
            if (m := re.fullmatch(r"imul\s+\$(0x[0-9a-f]+),%eax,%eax", i))
        ),
        None,
    )
    if shift is None:
        return None
    odd = pow(inv, -1, 1 << 32) if inv else 1
    return (1 << shift) * odd


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, what: str, ok: bool, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
        self.failed += not ok


def probe(libs: str, plugin: str | None, facts: bool) -> int:
    c = Checks()
    ver = version(libs)
    c.check("version", ver != "unknown", f"libnixl_common.so says NIXL {ver}")
    nixl = Elf(os.path.join(libs, "libnixl.so"))

    loader = nixl.find(r"_ZN12_GLOBAL__N_113backendLoader.*")
    api = (
        [
            int(m.group(1), 16)
            for i in nixl.disasm(loader)
            if (m := re.fullmatch(r"cmpl\s+\$(0x[0-9a-f]+),\(%rax\)", i))
        ]
        if loader
        else []
    )
    c.check(
        "plugin api_version",
        api == [PLUGIN_API_VERSION],
        f"backendLoader accepts {api} (header: {PLUGIN_API_VERSION})",
    )

    handle = {
        "create_engine": r"_ZNK23nixlBackendPluginHandle12createEngine.*",
        "destroy_engine": r"_ZNK23nixlBackendPluginHandle13destroyEngine.*",
        "get_plugin_name": r"_ZNK23nixlBackendPluginHandle7getNameEv",
        "get_plugin_version": r"_ZNK23nixlBackendPluginHandle10getVersionEv",
        "get_backend_options": r"_ZNK23nixlBackendPluginHandle17getBackendOptions.*",
        "get_backend_mems": r"_ZNK23nixlBackendPluginHandle14getBackendMemsEv",
    }
    got = {}
    for field, pat in handle.items():
        name = nixl.find(pat)
        got[field] = loaded_offset(nixl.disasm(name)) if name else None
    c.check("nixlBackendPlugin fields", got == PLUGIN_STRUCT, f"{got}")

    create = nixl.find(r"_ZN9nixlAgent13createBackend.*")
    init_err = (
        [
            int(m.group(1), 16)
            for i in nixl.disasm(create)
            if (m := re.fullmatch(r"cmpb\s+\$0x0,(0x[0-9a-f]+)\(%rax\)", i))
        ]
        if create
        else []
    )
    c.check(
        "initErr read by createBackend",
        INIT_ERR in init_err,
        f"cmpb at {[hex(x) for x in init_err]} (header: {hex(INIT_ERR)})",
    )

    build = Elf(os.path.join(libs, "libnixl_build.so"))
    sizes, lists = {}, {}
    for t in DESC_SIZES:
        tag = f"{len(t)}{t}"
        cnt = build.find(rf"_ZNK12nixlDescListI{tag}E9descCountEv")
        typ = build.find(rf"_ZNK12nixlDescListI{tag}E7getTypeEv")
        ins = build.disasm(cnt) if cnt else []
        sizes[t] = desc_size(ins)
        loads = [
            int(m.group(1), 16)
            for i in ins
            if (m := re.fullmatch(r"(?:mov|sub)\s+(0x[0-9a-f]+)\(%rdi\),%rax", i))
        ]
        tloads = [
            int(m.group(1), 16)
            for i in (build.disasm(typ) if typ else [])
            if (m := re.fullmatch(r"mov\s+(0x[0-9a-f]+)\(%rdi\),%eax", i))
        ]
        lists[t] = (tloads[:1], sorted(loads))
    c.check("descriptor sizes", sizes == DESC_SIZES, f"{sizes}")
    want = ([LIST_TYPE], [LIST_VECTOR, LIST_VECTOR + 8])
    c.check(
        "nixlDescList type/vector offsets",
        all(v == want for v in lists.values()),
        f"type @{LIST_TYPE}, vector begin/end @{LIST_VECTOR}/{LIST_VECTOR + 8} in every list"
        if all(v == want for v in lists.values())
        else f"{lists}",
    )

    shim_slots = shim_ctor = None
    if plugin:
        ours = Elf(plugin)
        shim_slots = ours.vtable(SHIM[0])
        shim_ctor = base_ctor(ours, SHIM[1], SHIM[0]) if SHIM[1] in ours.syms else None
        c.check(
            "plugin's ShimEngine constructor",
            shim_ctor is not None,
            f"{SHIM[1]} {'found' if shim_ctor else 'missing (inlined?)'} in {plugin}",
        )
    for lib, (vt, ctor) in ENGINES.items():
        path = os.path.join(libs, "plugins", lib)
        if not os.path.exists(path):
            c.check(f"{lib}", False, "missing from the wheel")
            continue
        elf = Elf(path)
        slots = elf.vtable(vt)
        c.check(
            f"{lib} vtable",
            len(slots) == VTABLE_SLOTS,
            f"{len(slots)} slots (header: {VTABLE_SLOTS})",
        )
        if shim_slots is not None:
            diff = [
                f"slot {i}: NIXL {sorted(a)} vs plugin {sorted(b)}"
                for i, (a, b) in enumerate(zip(slots, shim_slots))
                if not a & b
            ]
            c.check(
                f"{lib} vtable == plugin's",
                not diff and len(slots) == len(shim_slots),
                "every slot has the same signature" if not diff else "; ".join(diff[:3]),
            )
        if facts:
            for i, s in enumerate(slots):
                print(f"     slot {i:2}: {' = '.join(sorted(s))}")
        reads, writes = base_ctor(elf, ctor, vt)
        miss_r = sorted(set(INIT_READS) - reads)
        miss_w = sorted(set(BASE_WRITES) - writes)
        past = sorted(w for w in writes if w >= BASE_SIZE)
        c.check(
            f"{lib} base constructor",
            not miss_r and not miss_w and not past,
            f"reads init params at {[hex(x) for x in sorted(reads)]}, writes the engine at {[hex(x) for x in sorted(writes)]}"
            + (f"; missing reads {[hex(x) for x in miss_r]}" if miss_r else "")
            + (f"; missing writes {[hex(x) for x in miss_w]}" if miss_w else "")
            + (f"; writes past {BASE_SIZE}: {[hex(x) for x in past]}" if past else ""),
        )
    if shim_ctor:
        # Only the fields: the build static_asserts our sizeof, and the optimizer may move the
        # stores of ShimEngine's own members (from 208 on) before its vptr store.
        reads, writes = shim_ctor
        miss = sorted((set(INIT_READS) - reads) | (set(BASE_WRITES) - writes))
        c.check(
            "plugin's base constructor",
            not miss,
            f"same fields as NIXL's: reads {[hex(x) for x in sorted(INIT_READS)]}, writes {[hex(x) for x in sorted(BASE_WRITES)]}"
            if not miss
            else f"missing {[hex(x) for x in miss]}",
        )
    print(
        f"{'ABI ok' if not c.failed else f'ABI MISMATCH ({c.failed} checks failed)'}: NIXL {ver} ({libs})"
    )
    return 0 if not c.failed else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel_libs")
    ap.add_argument("--plugin", help="the built plugin (target/release/libio_uring_dmabuf.so)")
    ap.add_argument("--facts", action="store_true", help="also print every vtable slot")
    a = ap.parse_args()
    return probe(a.wheel_libs, a.plugin, a.facts)


if __name__ == "__main__":
    sys.exit(main())
