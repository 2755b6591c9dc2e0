#!/usr/bin/env bash
# The NVMe lab (ci/vm/README.md): builds the in-VM test binary (ci/vm/lab, statically linked),
# packs it as /init of a minimal initramfs, boots a kernel under QEMU (TCG) with an emulated
# NVMe disk, and passes or fails on the VM's final "LAB RESULT:" line.
#
#   ci/vm/run-lab.sh                      the kernel from ci/vm/fetch-kernel.sh (fetched if needed)
#   KVER=7.3.4+deb13-amd64 ci/vm/run-lab.sh   another Debian kernel release (fetched if needed)
#   KERNEL=/path/bzImage [MODULES=/path/lib/modules/<release>] ci/vm/run-lab.sh   any other kernel
#
# Environment (all optional):
#   KERNEL, MODULES     kernel image and its module tree (modules: only if udmabuf/nvme are modular)
#   KVER                a Debian kernel release to fetch and use (ignored when KERNEL is set)
#   LAB_MODULES         modules to pack and load if MODULES has them (default: "nvme udmabuf")
#   LAB_TIMEOUT         seconds before the VM is killed (default 600)
#   LAB_SMP, LAB_MEM    VM CPUs and memory (default 2, 1G)
#   LAB_DISK_MB         size of the NVMe disk image (default 256, at least 192)
#   LAB_APPEND          extra kernel command line (e.g. "loglevel=7" to drop the quiet boot)
#   LAB_UAPI            present|absent: what test c1 must find of the io_uring DMA-BUF uAPI
#                       (passed as iud_lab.uapi=). Default: absent for Debian kernels (none has
#                       it), unset for KERNEL= (c1 then reports without an expectation). Set
#                       LAB_UAPI=present for a kernel built with the patch series.
#   LAB_LINK            static (default: glibc static-pie) or dynamic (copies ldd's libraries)
#   LAB_STRICT=1        also fail when a test was skipped
#   LAB_NO_BUILD=1      reuse the last built binary
#   CARGO_TARGET_DIR    where cargo builds (default: the workspace's target/)
#   LAB_BENCH=1         benchmark instead of the tests (opt-in; nothing else changes without it):
#                       the engine (no NIXL) against fio (io_uring, fixedbufs, direct) on
#                       /dev/nvme0n1, one side-by-side table. fio (apt-get install -y fio if
#                       missing) and every library it links are packed into the initramfs.
#   LAB_BENCH_ARGS      options of `iud-lab --bench` (default "--duration-ms 300 --reps 1": WRITE,READ
#                       x rand,seq x 4K..1M x batch 1,32); see ci/vm/lab/src/bench.rs
#
# Exit status: 0 when the VM printed "LAB RESULT: N passed, 0 failed" with N > 0; 1 otherwise
# (test failures, no result line, kernel panic, timeout). LAB_BENCH=1: 0 when the VM printed
# "LAB BENCH DONE".
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="$here/work"
mkdir -p "$work"

log() { printf 'run-lab: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
t_start=$(now)

# --- kernel and tools -----------------------------------------------------------------------
if [ -n "${KERNEL:-}" ]; then
    "$here/fetch-kernel.sh" --tools-only
    [ -f "$KERNEL" ] || die "KERNEL=$KERNEL does not exist"
    KERNEL_GIVEN=1
    KVER="(given)"
    MODULES="${MODULES:-}"
else
    envf="$work/kernel${KVER:+-$KVER}.env"
    [ -f "$envf" ] || "$here/fetch-kernel.sh"
    "$here/fetch-kernel.sh" --tools-only
    # shellcheck source=/dev/null
    . "$envf"
    MODULES="${MODULES:-}"
fi
log "kernel: $KERNEL ($KVER)${MODULES:+, modules: $MODULES}"
# No released or Debian kernel has the uAPI (docs/kernel-dmabuf-series.md), so a fetched Debian
# kernel must lack it; a given KERNEL may be a patched build, so only LAB_UAPI says.
[ -n "${KERNEL_GIVEN:-}" ] || [ -n "${LAB_UAPI:-}" ] || LAB_UAPI=absent
case "${LAB_UAPI:-}" in
    ""|present|absent) ;;
    *) die "LAB_UAPI must be present or absent" ;;
esac
log "io_uring DMA-BUF uAPI expected: ${LAB_UAPI:-not stated (c1 reports only)}"

# --- the in-VM binary -----------------------------------------------------------------------
target=x86_64-unknown-linux-gnu
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
bin="$target_dir/$target/release/iud-lab"
t_build=$(now)
if [ -z "${LAB_NO_BUILD:-}" ]; then
    link="${LAB_LINK:-static}"
    case "$link" in
        static) rustflags="-C target-feature=+crt-static" ;;
        dynamic) rustflags="" ;;
        *) die "LAB_LINK must be static or dynamic" ;;
    esac
    log "building iud-lab ($link)"
    # An explicit --target keeps RUSTFLAGS off build scripts and proc macros (host artifacts).
    if ! (cd "$repo" && RUSTFLAGS="$rustflags" CARGO_TARGET_DIR="$target_dir" nice -n 10 \
        cargo build --release -p iud-lab --target "$target" 2>&1 \
        | sed -e '/dropping unsupported crate type `cdylib`/d' -e '/`io_uring_dmabuf` (lib) generated 1 warning/d' >&2); then
        die "cargo build of ci/vm/lab failed"
    fi
fi
[ -x "$bin" ] || die "no binary at $bin"
t_built=$(now)

# --- initramfs ------------------------------------------------------------------------------
root="$work/initramfs"
rm -rf "$root"
mkdir -p "$root"/{dev,proc,sys,tmp,lab}
strip --strip-debug -o "$root/init" "$bin" 2>/dev/null || cp "$bin" "$root/init"
chmod 755 "$root/init"
# The kernel opens /dev/console for /init before devtmpfs is mounted.
mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null || log "cannot mknod /dev/console (not root?); relying on the kernel's built-in one"

# (grep without -q: it reads to the end, so ldd never meets a closed pipe under pipefail)
if ldd "$bin" >/dev/null 2>&1 && ! ldd "$bin" 2>&1 | grep -c 'statically linked' >/dev/null; then
    log "dynamic binary: copying its libraries and the loader"
    # "libc.so.6 => /lib/.../libc.so.6 (0x...)" and the loader "/lib64/ld-linux-x86-64.so.2 (0x...)"
    ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | while read -r lib; do
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
fi

# LAB_BENCH: fio and its whole library closure (at their own paths; the loader searches the
# multiarch directories without an ld.so.cache), and the bench options that make /init benchmark.
bench_cmd=""
if [ -n "${LAB_BENCH:-}" ]; then
    if ! command -v fio >/dev/null; then
        log "installing fio (apt-get install -y fio)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y fio >&2
    fi
    fio_bin="$(command -v fio)"
    mkdir -p "$root/usr/bin"
    cp -L "$fio_bin" "$root/usr/bin/fio"
    ldd "$fio_bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | while read -r lib; do
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
    bench_cmd="--fio /usr/bin/fio ${LAB_BENCH_ARGS:---duration-ms 300 --reps 1}"
    echo "$bench_cmd" >"$root/lab/bench.args"
    log "LAB_BENCH: packed $("$fio_bin" --version) with $(ldd "$fio_bin" | grep -c '/') libraries; /init runs: iud-lab --bench $bench_cmd"
fi

# Modules: only those the kernel has as files (built-in ones are simply not found), with their
# dependencies first, decompressed so that finit_module needs no decompressor in the kernel.
packed=()
ko_path() {
    local a="${1//_/-}" b="${1//-/_}"
    # -print -quit: find stops at the first match itself (no `| head`, whose early exit could
    # kill find with SIGPIPE under pipefail)
    find "$MODULES" -type f \( -name "$a.ko" -o -name "$a.ko.*" -o -name "$b.ko" -o -name "$b.ko.*" \) -print -quit 2>/dev/null
}
ko_cat() {
    case "$1" in
        *.ko.xz) xz -dc "$1" ;;
        *.ko.zst) zstd -qdc "$1" ;;
        *.ko.gz) gzip -dc "$1" ;;
        *) cat "$1" ;;
    esac
}
add_module() {
    local name="${1//-/_}" path dep
    for p in "${packed[@]:-}"; do [ "$p" = "$name" ] && return 0; done
    path="$(ko_path "$name")"
    [ -n "$path" ] || return 0
    mkdir -p "$root/lab/modules"
    ko_cat "$path" >"$root/lab/modules/$name.ko"
    for dep in $(tr '\0' '\n' <"$root/lab/modules/$name.ko" | sed -n 's/^depends=//p' | sed -n 1p | tr ',' ' '); do
        add_module "$dep"
    done
    packed+=("$name")
    echo "/lab/modules/$name.ko" >>"$root/lab/modules.list"
}
if [ -n "$MODULES" ]; then
    for m in ${LAB_MODULES:-nvme udmabuf}; do add_module "$m"; done
fi
if [ ${#packed[@]} -gt 0 ]; then
    log "packed modules (load order): ${packed[*]}"
else
    log "no modules packed: ${LAB_MODULES:-nvme udmabuf} are built into this kernel (or missing; the VM reports which)"
fi

initrd="$work/initramfs.cpio.gz"
(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet | gzip -1 >"$initrd")
log "initramfs: $initrd ($(du -k "$initrd" | cut -f1) KiB)"

# --- disk -----------------------------------------------------------------------------------
img="$work/nvme.img"
[ "${LAB_DISK_MB:-256}" -ge 192 ] || die "LAB_DISK_MB must be at least 192 (the tests use the first 192 MiB)"
rm -f "$img"
truncate -s "${LAB_DISK_MB:-256}M" "$img"

# --- boot -----------------------------------------------------------------------------------
[ -z "${LAB_BENCH:-}" ] || load_before="$(uptime)"
timeout_s="${LAB_TIMEOUT:-600}"
vmlog="$work/lab.log"
log "booting (TCG, timeout ${timeout_s}s); console output follows and is kept in $vmlog"
t_boot=$(now)
set +e
timeout -k 10 "$timeout_s" qemu-system-x86_64 \
    -accel tcg,thread=single -m "${LAB_MEM:-1G}" -smp "${LAB_SMP:-2}" \
    -nographic -no-reboot -nic none \
    -kernel "$KERNEL" -initrd "$initrd" \
    -append "console=ttyS0 panic=-1 quiet${LAB_UAPI:+ iud_lab.uapi=$LAB_UAPI} ${LAB_APPEND:-}" \
    -drive "file=$img,if=none,id=nv,format=raw" -device nvme,serial=iudlab1,drive=nv \
    </dev/null 2>&1 | tee "$vmlog"
qemu_rc=${PIPESTATUS[0]}
set -e
t_end=$(now)
rm -f "$img"

# --- verdict --------------------------------------------------------------------------------
clean="$(tr -d '\r' <"$vmlog")"
if [ -n "${LAB_BENCH:-}" ]; then
    log "times: build $(secs "$t_build" "$t_built") s, VM $(secs "$t_boot" "$t_end") s, total $(secs "$t_start" "$t_end") s"
    done_line="$(printf '%s\n' "$clean" | grep -a '^LAB BENCH ' | tail -1 || true)"
    echo
    echo "# DRAM <-> BLK on the lab's emulated NVMe: the engine (no NIXL) vs fio, inside the VM"
    echo "date:     $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "git:      $(cd "$repo" && git rev-parse --short HEAD 2>/dev/null || echo unknown)$(cd "$repo" && [ -n "$(git status --porcelain -- src Cargo.toml Cargo.lock ci/vm/lab 2>/dev/null)" ] && echo ' + uncommitted changes in src/ or ci/vm/lab/')"
    echo "command:  LAB_BENCH=1${LAB_BENCH_ARGS:+ LAB_BENCH_ARGS=\"$LAB_BENCH_ARGS\"} ci/vm/run-lab.sh"
    echo "host:     $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | sed -n 1p) ($(nproc) CPUs), kernel $(uname -r), $(qemu-system-x86_64 --version | sed -n 1p)"
    echo "VM:       kernel $KVER, TCG (thread=single), -smp ${LAB_SMP:-2} -m ${LAB_MEM:-1G}, -device nvme on a sparse raw file (QEMU default cache: host page cache)"
    echo "in VM:    iud-lab --bench $bench_cmd"
    printf '%s\n' "$clean" | grep -a -e '^INFO /dev/nvme0n1' -e '^INFO bench' | sed 's/^INFO /info:     /'
    echo "load before: $load_before"
    echo "load after:  $(uptime)"
    echo
    printf '%s\n' "$clean" | sed -n 's/^TABLE //p'
    if [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
        die "timeout: the VM did not power off within ${timeout_s}s"
    fi
    [ "$done_line" = "LAB BENCH DONE" ] || die "${done_line:-no 'LAB BENCH' line from the VM (qemu exit $qemu_rc)}"
    exit 0
fi
result="$(printf '%s\n' "$clean" | grep -a '^LAB RESULT:' | tail -1 || true)"
log "times: build $(secs "$t_build" "$t_built") s, VM $(secs "$t_boot" "$t_end") s, total $(secs "$t_start" "$t_end") s"
if [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
    die "timeout: the VM did not power off within ${timeout_s}s${result:+ (last result: $result)}"
fi
if [ -z "$result" ]; then
    printf '%s\n' "$clean" | tail -15 | sed 's/^/    | /' >&2
    die "no 'LAB RESULT:' line from the VM (qemu exit $qemu_rc)"
fi
passed="$(sed -n 's/^LAB RESULT: \([0-9]*\) passed.*/\1/p' <<<"$result")"
failed="$(sed -n 's/^LAB RESULT: [0-9]* passed, \([0-9]*\) failed.*/\1/p' <<<"$result")"
skipped="$(sed -n 's/.* \([0-9]*\) skipped.*/\1/p' <<<"$result")"
[ -n "$passed" ] && [ -n "$failed" ] || die "cannot parse '$result'"
if [ "$failed" != 0 ]; then
    printf '%s\n' "$clean" | grep -a '^FAIL ' >&2 || true
    die "$result"
fi
[ "$passed" -gt 0 ] || die "$result (nothing passed)"
if [ "${skipped:-0}" != 0 ]; then
    printf '%s\n' "$clean" | grep -a '^SKIP ' | sed 's/^/    /' >&2 || true
    [ -z "${LAB_STRICT:-}" ] || die "$result (LAB_STRICT: skips fail)"
fi
log "OK: $result"
