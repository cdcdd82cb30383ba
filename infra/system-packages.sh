#!/usr/bin/env bash
# Debian packages the tests run as real parts: Prometheus (and promtool) for the dashboard and alert
# checks, Chromium for the pages a reviewer reads. Installed only when missing; without root or apt the
# install goes on and names what to install, and the tests that need them fail saying so.
set -uo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install: please install the Debian packages: ${need[*]} (tests that use them fail without)" >&2
  exit 0
fi
echo "install: Debian packages ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# the package's service is not wanted (tests start their own Prometheus on a free port): a policy-rc.d
# that refuses service starts keeps apt from starting it, then goes
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && made_policy=1; fi
apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
  || echo "install: apt-get could not install ${need[*]}" >&2
[ "$made_policy" = 1 ] && rm -f "$policy"
exit 0
