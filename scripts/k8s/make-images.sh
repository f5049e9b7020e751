#!/bin/bash
# Root-fs tarballs for `docker import` (no registry anywhere), cached by dependency hash in $K8S_IMAGES:
#   pause-<h>.tar         static /pause built with gcc from the kubernetes source (build/pause/linux/pause.c)
#   busybox-<h>.tar       Debian's busybox-static + applet symlinks (~2 MB)
#   sampler-base-<h>.tar  debootstrap --variant=minbase bookworm + the shared libraries the HOST's Python
#                         (pyenv 3.11) and the project venv (torch/vLLM wheels) link against. No Python inside:
#                         pods mount the host's interpreter tree, the venv and the repo read-only via hostPath
#                         (see README.md "sampler-base").
# and $K8S_IMAGES/images.list ("TAG|TARBALL|docker-import --change") read by node-up.sh.
# Cached: ~0.1 s. Cold: sampler-base ~1 min (debootstrap from the Debian mirror).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
mkdir -p "$K8S_IMAGES"
SRC=$(ls -d "$K8S_CACHE"/src/kubernetes-*/ 2>/dev/null | head -1)
PAUSE_C=${SRC}build/pause/linux/pause.c
[ -f "$PAUSE_C" ] || { echo "missing $PAUSE_C: run scripts/k8s/build.sh first" >&2; exit 1; }
MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
RECIPE=2   # bump when a recipe below changes
# runtime libraries of pyenv's CPython (lib-dynload: ssl, sqlite3, ctypes, curses, readline, lzma, bz2, uuid, nis ...)
# and of the venv's wheels (torch: libgomp, libnuma; pillow/matplotlib-ish deps) -- from `ldd` on the host trees.
BASE_PKGS="libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libreadline8 libncursesw6 libtinfo6 zlib1g libuuid1 \
libnsl2 libtirpc3 libexpat1 libcrypt1 libgomp1 libnuma1 libstdc++6 libgcc-s1 libbrotli1 libelf1 libpng16-16 \
libfreetype6 libfontconfig1 libgssapi-krb5-2 libbsd0 libmd0 procps"

h() { { echo "$RECIPE"; cat "$@"; } | sha256sum | cut -c1-12; }
LIST=$K8S_IMAGES/images.list.tmp; : > "$LIST"

# --- pause ---
H=$(h "$PAUSE_C"); T=$K8S_IMAGES/pause-$H.tar
if [ ! -f "$T" ]; then
  t=$(ts); W=$(mktemp -d); mkdir -p "$W/r"
  gcc -Os -Wall -Werror -static -DVERSION=v3.4-local -o "$W/r/pause" "$PAUSE_C" && strip "$W/r/pause"
  tar -C "$W/r" -cf "$T.tmp" pause; mv "$T.tmp" "$T"; rm -rf "$W"; echo "[images] pause: $(el $t)" >&2
fi
echo "local/pause:3.4|$T|ENTRYPOINT [\"/pause\"]" >> "$LIST"

# --- busybox ---
H=$(h /usr/bin/busybox); T=$K8S_IMAGES/busybox-$H.tar
if [ ! -f "$T" ]; then
  t=$(ts); W=$(mktemp -d); R=$W/r; mkdir -p $R/bin $R/etc $R/tmp $R/proc $R/sys $R/dev
  cp /usr/bin/busybox $R/bin/; for a in $($R/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox $R/bin/$a; done
  tar -C $R -cf "$T.tmp" .; mv "$T.tmp" "$T"; rm -rf "$W"; echo "[images] busybox: $(el $t)" >&2
fi
echo "local/busybox:dev|$T|CMD [\"/bin/sh\"]" >> "$LIST"

# --- sampler-base ---
H=$(echo "$BASE_PKGS bookworm minbase" | h); T=$K8S_IMAGES/sampler-base-$H.tar
if [ ! -f "$T" ]; then
  t=$(ts); W=$(mktemp -d -p "$K8S_IMAGES" .build-XXXX); R=$W/rootfs
  # own mount namespace: whatever debootstrap mounts inside the target disappears with it
  unshare -m --propagation private debootstrap --variant=minbase --include="$(echo $BASE_PKGS | tr ' ' ,)" \
    bookworm "$R" "$MIRROR" > "$W/debootstrap.log" 2>&1 || { tail -20 "$W/debootstrap.log" >&2; exit 1; }
  rm -rf $R/var/cache/apt/archives/*.deb $R/var/cache/apt/*.bin $R/var/lib/apt/lists/*_* $R/etc/resolv.conf
  tar -C "$R" -cf "$T.tmp" .; mv "$T.tmp" "$T"; rm -rf "$W"
  echo "[images] sampler-base (debootstrap minbase + runtime libs): $(el $t)" >&2
fi
echo "local/sampler-base:dev|$T|CMD [\"/bin/bash\"]" >> "$LIST"
mv -f "$LIST" "$K8S_IMAGES/images.list"
# drop superseded tarballs
for f in "$K8S_IMAGES"/*.tar; do grep -q "|$f|" "$K8S_IMAGES/images.list" || rm -f "$f"; done
