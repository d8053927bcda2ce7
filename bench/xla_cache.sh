# Sourced by the GPU scripts: JAX's persistent compilation cache in the checkout (.xla-cache/,
# git-ignored), restored from .xla-cache.tgz when a call carries it and packed into $OUT at the
# end, so the next call skips the compiles even on a fresh machine:
#   cat <files_at>/xla-cache.tgz* > .xla-cache.tgz; run(..., carry=[".xla-cache.tgz"])
# $OUT brings back files of at most 16 MiB: a larger archive comes back in 15 MiB parts
# (xla-cache.tgz.part00, .part01, ...), which `cat` joins. Carry at most 64 MiB in all.
# Entries are keyed by the HLO, the device and the jax/XLA versions: a stale one is never used.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.xla-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
if [[ -f .xla-cache.tgz ]]; then
  tar xzf .xla-cache.tgz -C "$JAX_COMPILATION_CACHE_DIR" && \
    echo "xla cache: restored $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries"
fi
xla_cache_save() {  # XLA_CACHE_SAVE=0: not at all (every script that sources this file)
  [[ -n ${OUT:-} && ${XLA_CACHE_SAVE:-1} != 0 ]] || return 0
  local tgz=/tmp/xla-cache.tgz
  tar czf "$tgz" -C "$JAX_COMPILATION_CACHE_DIR" . || return 0
  rm -f "$OUT"/xla-cache.tgz*
  if (( $(stat -c %s "$tgz") <= 15 * 1024 * 1024 )); then
    cp "$tgz" "$OUT/xla-cache.tgz"
  else
    split -b 15M -d -a 2 "$tgz" "$OUT/xla-cache.tgz.part"
  fi
  echo "xla cache: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries, $(du -h "$tgz" | cut -f1) packed" \
       "in $(ls "$OUT"/xla-cache.tgz* | wc -l) file(s)"
}
