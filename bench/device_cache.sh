#!/usr/bin/env bash
# The compiled-kernel disk cache across GPU calls (each call may start on a fresh machine, and compiling is
# most of a GPU test run). Usage, from the project root on the GPU machine:
#   source bench/device_cache.sh restore   # before: unpack .device-cache/cubin-cache.tar.xz if it travelled
#   bash bench/device_cache.sh save        # after: pack $STRICTNORM_CACHE_DIR into $OUT (the newest entries, 15 MiB)
# Back on the development machine, copy the returned cubin-cache.tar.xz into .device-cache/ (ignored by git)
# and name .device-cache in the next call's carry. Entries are keyed by source, macros, architecture and NVRTC
# version, so a cache from another commit is harmless (stale entries are never hit).
export STRICTNORM_CACHE_DIR=${STRICTNORM_CACHE_DIR:-/tmp/strictnorm-cache}
case "${1:-}" in
  restore)
    # a damaged archive (a call cut off while packing) is left out whole: a part of it may end in a cut file
    if [ -f .device-cache/cubin-cache.tar.xz ] && ! xz -t .device-cache/cubin-cache.tar.xz 2>/dev/null; then
      echo "cubin cache: the archive is damaged, not restored"
    elif [ -f .device-cache/cubin-cache.tar.xz ]; then
      mkdir -p "$STRICTNORM_CACHE_DIR" && tar -xJf .device-cache/cubin-cache.tar.xz -C "$STRICTNORM_CACHE_DIR" &&
        echo "cubin cache: $(find "$STRICTNORM_CACHE_DIR" -name '*.cubin' | wc -l) kernels restored"
    fi ;;
  save)
    out=${OUT:-/tmp/strictnorm-out}/cubin-cache.tar.xz
    list=$(mktemp)
    # the newest entries first (compiled in this call, then the restored ones by their compile time), as many as
    # fit under 15 MiB packed (a kernel packs to about 4 KB)
    (cd "$STRICTNORM_CACHE_DIR" && find . -type f -printf '%T@ %p\n' | sort -rn | cut -d' ' -f2-) > "$list"
    for keep in 0 4000 3000 2000 1000; do
      if [ "$keep" = 0 ]; then cp "$list" "$list.keep"; else head -n "$keep" "$list" > "$list.keep"; fi
      # packed beside, then renamed: a call cut off while packing leaves no damaged archive behind
      tar -cJf "$out.part" -C "$STRICTNORM_CACHE_DIR" -T "$list.keep" 2>/dev/null && mv "$out.part" "$out"
      [ "$(stat -c %s "$out" 2>/dev/null || echo 0)" -le $((15 * 1024 * 1024)) ] && break
      rm -f "$out"
    done
    if [ -f "$out" ]; then
      echo "cubin cache: $(grep -c '\.cubin$' "$list.keep") of $(grep -c '\.cubin$' "$list") kernels in $out"
    else
      echo "cubin cache over 15 MiB: not returned"
    fi
    rm -f "$list" "$list.keep" ;;
  *) echo "usage: source bench/device_cache.sh restore | bash bench/device_cache.sh save" >&2 ;;
esac
