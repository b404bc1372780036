#!/usr/bin/env bash
# Create (or reuse) third_party/.pd-deps: what a CPU prefill/decode (PD) pair of SGLang servers
# needs beyond the project's venv, for the PD test (tests/integration/test_pd_server.py):
#   site/    mooncake-transfer-engine-non-cuda 0.3.13.post1 (SGLang's Mooncake transfer backend,
#            run over TCP: --disaggregation-transfer-backend mooncake_tcp); put on PYTHONPATH
#   router/  sglang-router 0.3.2 (the PD router: --pd-disaggregation --mini-lb); on PYTHONPATH
#   libs/    Debian bookworm's libibverbs1, libnl-3-200 and libnl-route-3-200, which mooncake's
#            engine.so links even when it never touches an RDMA device; on LD_LIBRARY_PATH
# Both wheels are installed with --no-deps --target and --require-hashes (sha256 of PyPI's
# files, x86_64); their runtime dependencies (aiohttp, requests, msgpack, setproctitle, orjson,
# uvicorn, fastapi) are in the project's venv already (checked at the end). The .debs are
# unpacked with dpkg-deb -x (no root), fetched with `apt-get download` or, where apt has no
# lists, from deb.debian.org's pool; either way their sha256 is checked. Idempotent (stamp
# file); the folder is gitignored. `make test` runs this first.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-.venv/bin/python}"
DIR=third_party/.pd-deps
STAMP="$DIR/.setup-stamp"
WHEELS=(
  "mooncake-transfer-engine-non-cuda==0.3.13.post1 --hash=sha256:ca9f668a04ffe648b250fda28b97d0a7da149cb110dec5cf3d166a9e68afc940|site"
  "sglang-router==0.3.2 --hash=sha256:ba5a24951e5e0357fe390782fcd1abd861448a87216832dbf2e501a1dd1548eb|router"
)
# name version pool-path sha256 (Debian bookworm, amd64)
DEBS=(
  "libibverbs1 44.0-2 r/rdma-core 35054815259fee46173240254246d03b673a5cd5c528aaac96fd15ac428a8d59"
  "libnl-3-200 3.7.0-0.2+b1 libn/libnl3 d1fc3e9eb8e79b4c96b0a64c3d8c9e068ae2f665cab71bd19f417ffd0453a890"
  "libnl-route-3-200 3.7.0-0.2+b1 libn/libnl3 0fdcc425ae2982788c085c76a7cb0eda3e3db99d41bd1ce56082ee18e9f1e21f"
)
LIBS="$PWD/$DIR/libs/usr/lib/x86_64-linux-gnu:$PWD/$DIR/libs/lib/x86_64-linux-gnu"

check() {
  LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONPATH="$DIR/site:$DIR/router" \
    "$PY" -c "from mooncake.engine import TransferEngine; import sglang_router.launch_router
import aiohttp, requests, msgpack, setproctitle, orjson, uvicorn, fastapi"
}

want="$(printf '%s\n' "${WHEELS[@]}" "${DEBS[@]}" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && check 2>/dev/null; then
  echo "setup_pd_deps: $DIR is up to date"
  exit 0
fi
if [[ "$(uname -m)" != x86_64 ]]; then
  echo "setup_pd_deps: the pinned wheels and .debs are x86_64 only (this is $(uname -m))" >&2
  exit 1
fi
rm -rf "$DIR"
mkdir -p "$DIR/debs" "$DIR/libs"
for entry in "${WHEELS[@]}"; do
  req="${entry%|*}"
  target="$DIR/${entry##*|}"
  echo "setup_pd_deps: installing ${req%% *} into $target (--no-deps, sha256 pinned)"
  printf '%s\n' "$req" > "$DIR/req.txt"
  "$PY" -m pip --disable-pip-version-check install -q --no-deps --require-hashes \
    --only-binary :all: --target "$target" -r "$DIR/req.txt"
done
rm -f "$DIR/req.txt"
for entry in "${DEBS[@]}"; do
  read -r name version pool sha <<< "$entry"
  file="${name}_${version}_amd64.deb"
  echo "setup_pd_deps: unpacking $name $version into $DIR/libs (sha256 checked)"
  if ! (cd "$DIR/debs" && apt-get download -q "$name=$version" >/dev/null 2>&1); then
    # apt-get download names the file with the epoch-escaped version; the pool URL is fixed
    curl -fsSL -o "$DIR/debs/$file" "https://deb.debian.org/debian/pool/main/$pool/$file"
  fi
  got="$(ls "$DIR/debs/${name}_"*"_amd64.deb")"
  echo "$sha  $got" | sha256sum -c --quiet -
  dpkg-deb -x "$got" "$DIR/libs"
done
if LD_LIBRARY_PATH="$LIBS" ldd "$DIR/site/mooncake/engine.so" | grep "not found"; then
  echo "setup_pd_deps: mooncake's engine.so misses the libraries above" >&2
  exit 1
fi
check
echo "$want" > "$STAMP"
echo "setup_pd_deps: done ($DIR: site/ and router/ on PYTHONPATH, libs on LD_LIBRARY_PATH)"
