#!/usr/bin/env bash
# Configures and builds a small x86-64 kernel for the NVMe lab (ci/vm/README.md) from a source
# tree you prepared, e.g. Linux 7.2.6 with the io_uring DMA-BUF patch series applied
# (docs/kernel-dmabuf-series.md, "The lab kernel"). Neither the source nor the patches belong
# in this repository: keep them under the git-ignored ci/vm/work/.
#
# Usage: ci/vm/build-lab-kernel.sh <kernel source tree> [<build dir>]
#   build dir: default ci/vm/work/kbuild (out-of-tree: make O=...)
# Then:   LAB_UAPI=present KERNEL=<build dir>/arch/x86/boot/bzImage ci/vm/run-lab.sh
#
# Configuration: `make tinyconfig`, the options below enabled with scripts/config, then
# `make olddefconfig`. The build fails early unless IO_URING, BLK_DEV_NVME, UDMABUF and, when the
# tree has the series, its gate DMABUF_TOKEN (v3) came out =y. (PARAVIRT and KVM_GUEST stay off:
# they depend on HYPERVISOR_GUEST, which is not in the list; TCG does not need them.)
# Environment: JOBS (default 2), NICE (default 10).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf 'build-lab-kernel: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -ge 1 ] || die "usage: $0 <kernel source tree> [<build dir>]"
src="$(cd "$1" && pwd)"
[ -f "$src/Makefile" ] && [ -x "$src/scripts/config" ] || die "$src is not a kernel source tree"
out="${2:-$here/work/kbuild}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

options=(64BIT SMP PRINTK TTY SERIAL_8250 SERIAL_8250_CONSOLE BLK_DEV_INITRD RD_GZIP DEVTMPFS
    DEVTMPFS_MOUNT BINFMT_ELF PROC_FS SYSFS TMPFS SHMEM MEMFD_CREATE IO_URING BLOCK PCI PCI_MSI
    BLK_DEV_NVME DMABUF_HEAPS DMABUF_HEAPS_SYSTEM DMA_SHARED_BUFFER UDMABUF FUTEX EPOLL EVENTFD
    SIGNALFD TIMERFD POSIX_TIMERS MULTIUSER FILE_LOCKING PROC_SYSCTL ACPI PARAVIRT KVM_GUEST AIO)

make -C "$src" O="$out" -s tinyconfig
for o in "${options[@]}"; do "$src/scripts/config" --file "$out/.config" -e "$o"; done
make -C "$src" O="$out" -s olddefconfig

need=(IO_URING BLK_DEV_NVME UDMABUF DMA_SHARED_BUFFER DEVTMPFS BLK_DEV_INITRD SERIAL_8250_CONSOLE)
if grep -qs '^config DMABUF_TOKEN' "$src/lib/Kconfig"; then need+=(DMABUF_TOKEN); fi
for o in "${need[@]}"; do
    grep -q "^CONFIG_$o=y" "$out/.config" || die "CONFIG_$o is not =y after olddefconfig"
done
log "config: ${need[*]} =y ($out/.config)"

t0=$(date +%s)
nice -n "${NICE:-10}" make -C "$src" O="$out" -j"${JOBS:-2}" bzImage >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; die "make bzImage failed (log: $out/build.log)"; }
log "built $out/arch/x86/boot/bzImage in $(($(date +%s) - t0)) s (log: $out/build.log)"
echo "$out/arch/x86/boot/bzImage"
