#!/usr/bin/env bash
# The compiled-kernel disk cache across GPU calls (each call may start on a fresh machine, and compiling is
# most of a GPU test run). Usage, from the project root on the GPU machine:
#   source bench/device_cache.sh restore   # before: unpack .device-cache/cubin-cache.tar.xz if it travelled
#   bash bench/device_cache.sh save        # after: pack $STRICTNORM_CACHE_DIR into $OUT (if under 15 MiB)
# Back on the development machine, copy the returned cubin-cache.tar.xz into .device-cache/ (ignored by git)
# and name .device-cache in the next call's carry. Entries are keyed by source, macros, architecture and NVRTC
# version, so a cache from another commit is harmless (stale entries are never hit).
export STRICTNORM_CACHE_DIR=${STRICTNORM_CACHE_DIR:-/tmp/strictnorm-cache}
case "${1:-}" in
  restore)
    if [ -f .device-cache/cubin-cache.tar.xz ]; then
      mkdir -p "$STRICTNORM_CACHE_DIR" && tar -xJf .device-cache/cubin-cache.tar.xz -C "$STRICTNORM_CACHE_DIR" &&
        echo "cubin cache: $(find "$STRICTNORM_CACHE_DIR" -name '*.cubin' | wc -l) kernels restored"
    fi ;;
  save)
    out=${OUT:-/tmp/strictnorm-out}/cubin-cache.tar.xz
    tar -cJf "$out" -C "$STRICTNORM_CACHE_DIR" . 2>/dev/null
    if [ "$(stat -c %s "$out" 2>/dev/null || echo 0)" -gt $((15 * 1024 * 1024)) ]; then
      rm -f "$out"; echo "cubin cache over 15 MiB: not returned"
    else
      echo "cubin cache: $(find "$STRICTNORM_CACHE_DIR" -name '*.cubin' | wc -l) kernels in $out"
    fi ;;
  *) echo "usage: source bench/device_cache.sh restore | bash bench/device_cache.sh save" >&2 ;;
esac
