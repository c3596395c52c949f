#!/usr/bin/env bash
# Install Debian's Chromium, the headless browser that tests/test_report_browser.py drives.
#   bash scripts/install_chromium.sh
# Idempotent: does nothing when /usr/bin/chromium exists. Runs as root (CI) or through sudo, with no input.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "install_chromium: already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install_chromium: not root and no sudo: run 'apt-get install chromium' as root" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "install_chromium: apt-get update"
$SUDO apt-get update -q
# A font, so that text renders as letters in screenshots (chromium itself only recommends one).
echo "install_chromium: apt-get install chromium fonts-dejavu-core"
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
echo "install_chromium: installed: $(/usr/bin/chromium --version)"
