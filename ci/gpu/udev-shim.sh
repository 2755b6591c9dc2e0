#!/usr/bin/env bash
# cuFile asks udev for the file system of the block device under a file (ID_FS_USAGE). On
# machines without udevd (the GPU machine is a Firecracker VM with no /run/udev), that lookup
# fails and cuFileHandleRegister returns 5027 (CU_FILE_HANDLE_NOT_REGISTERED) for every file,
# in compatibility mode too ("udev property not found: ID_FS_USAGE vda" in a TRACE cufile log).
# This writes the udev database entry for the block device behind each given path, as udevd
# would. Needs root; changes nothing when the entry exists.
set -euo pipefail
for path in "${@:-/}"; do
    src=$(findmnt -n -o SOURCE -T "$path")
    fstype=$(findmnt -n -o FSTYPE -T "$path")
    [ -b "$src" ] || { echo "udev-shim: $path is not on a block device ($src)"; continue; }
    majmin=$(printf '%d:%d' "0x$(stat -L -c %t "$src")" "0x$(stat -L -c %T "$src")")
    entry=/run/udev/data/b$majmin
    if [ -e "$entry" ]; then echo "udev-shim: $entry exists"; continue; fi
    mkdir -p /run/udev/data
    printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\nE:DEVTYPE=disk\n' "$fstype" > "$entry"
    echo "udev-shim: wrote $entry for $src ($fstype)"
done
