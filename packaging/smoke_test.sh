#!/usr/bin/env bash
# Smoke test of the packaged app: unpack the .deb into a temp folder and run its
# --self-test (the window, offscreen, answering one question with the bundled model)
# with no network, no Python environment (`env -i`: no PYTHONPATH, no venv) and an
# empty HOME. No network means a new network namespace (`unshare -n`, needs root or
# user namespaces); where that is refused, proxies that point at a closed port.
#
#   packaging/smoke_test.sh [dist/attnchat_<version>_<arch>.deb]     (make package-smoke)
set -euo pipefail
cd "$(dirname "$0")/.."
deb=${1:-$(ls -t dist/attnchat_*.deb 2>/dev/null | head -n 1)}
if [ -z "$deb" ] || [ ! -f "$deb" ]; then
    echo "smoke_test: no .deb in dist/; run make package first" >&2
    exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dpkg-deb -x "$deb" "$tmp/root"
mkdir "$tmp/home"
app="$tmp/root/opt/attnchat/attnchat"
env_vars=(HOME="$tmp/home" PATH=/usr/bin:/bin LANG=C.UTF-8 QT_QPA_PLATFORM=offscreen)
if unshare -n true 2>/dev/null; then
    offline=(unshare -n) how="unshare -n (a network namespace with no interfaces up)"
elif unshare -rn true 2>/dev/null; then
    offline=(unshare -rn) how="unshare -rn (a user and network namespace)"
else
    offline=() how="proxies pointing at a closed port (unshare is not permitted here)"
    env_vars+=(http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9
               HTTPS_PROXY=http://127.0.0.1:9 no_proxy= NO_PROXY=)
fi
echo "smoke test: $deb unpacked in $tmp/root; offline via $how; empty HOME $tmp/home"
start=$(date +%s)
"${offline[@]}" env -i "${env_vars[@]}" "$app" --self-test
echo "smoke test passed in $(( $(date +%s) - start )) s; the app wrote:"
(cd "$tmp/home" && find . -maxdepth 3 -mindepth 1 | sort)
