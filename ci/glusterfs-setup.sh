#!/usr/bin/env bash
# What the shared-file-system tests (tests/python/test_vllm_store_glusterfs.py and
# tests/python/clients/test_vllm_glusterfs_engines.py) need: GlusterFS (Debian 12: 10.3) server
# and FUSE client, and iproute2 for the network namespaces. The tests start their own glusterd in
# a namespace, with its own working and run folders, so a system glusterd is not used: where the
# package's install started one (systemd machines), it is stopped and disabled again.
# Idempotent and quiet when everything is there. `ci/glusterfs-setup.sh --needs` prints what is
# missing and exits. The test fixture runs this script (as root) when something is missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v glusterd >/dev/null 2>&1 || need+=(glusterfs-server)
command -v glusterfs >/dev/null 2>&1 || need+=(glusterfs-client)
if [ "${1:-}" = --needs ]; then
    echo "${need[*]}"
    exit 0
fi
[ ${#need[@]} -gt 0 ] || exit 0

iud_apt_install ci/glusterfs-setup.sh --no-install-recommends "${need[@]}"
installed_server=0
[[ " ${need[*]} " == *" glusterfs-server "* ]] && installed_server=1
if [ "$installed_server" = 1 ] && [ -d /run/systemd/system ] &&
    systemctl is-enabled glusterd >/dev/null 2>&1; then
    echo "ci/glusterfs-setup.sh: stopping and disabling the system glusterd the package started"
    iud_sudo systemctl disable --now glusterd >/dev/null 2>&1 || true
fi
