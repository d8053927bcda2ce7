# Sourced by the GPU scripts: JAX's persistent compilation cache in the checkout (.xla-cache/,
# git-ignored), restored from .xla-cache.tgz when a call carries it and packed into
# $OUT/xla-cache.tgz at the end, so the next call skips the compiles even on a fresh machine:
#   run(..., carry=[".xla-cache.tgz"])   after copying the last call's $OUT/xla-cache.tgz here.
# Entries are keyed by the HLO, the device and the jax/XLA versions: a stale one is never used.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.xla-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
if [[ -f .xla-cache.tgz ]]; then
  tar xzf .xla-cache.tgz -C "$JAX_COMPILATION_CACHE_DIR" && \
    echo "xla cache: restored $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries"
fi
xla_cache_save() {
  [[ -n ${OUT:-} ]] || return 0
  tar czf "$OUT/xla-cache.tgz" -C "$JAX_COMPILATION_CACHE_DIR" . && \
    echo "xla cache: $(ls "$JAX_COMPILATION_CACHE_DIR" | wc -l) entries, $(du -h "$OUT/xla-cache.tgz" | cut -f1) packed"
}
