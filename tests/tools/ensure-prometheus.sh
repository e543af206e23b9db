#!/bin/sh
# Makes sure a `prometheus` binary is on PATH for tests/integration/test_dashboard.py: a no-op where one is, Debian's package
# where apt-get can install it (root), and a loud failure otherwise (the dashboard test never skips).
set -eu
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus is not installed and cannot be installed here (needs root and apt-get):" \
         "install it (Debian/Ubuntu: apt-get install prometheus; or put the release binary on PATH)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: only the server, not the node exporter; Debian's policy-rc.d keeps the service unstarted
# in containers, and where systemd does start it, the tests still use their own instance on free ports.
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null 2>&1 || { echo "apt-get installed prometheus but it is not on PATH" >&2; exit 1; }
