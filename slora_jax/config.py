"""EngineConfig: every option of the engine, in one place, with vLLM's names where the meaning is
the same. `LLM(model, **fields)` and `slora-jax serve --flag` both fill it.

The model's own shape (layers, heads, vocabulary) is not an option: it comes from the model
directory's config.json or a shape in configs/models (slora_jax.model.config.ModelConfig).
"""

from __future__ import annotations

import dataclasses
import os

LORA_BACKENDS = ("auto", "xla", "pallas", "ranksplit", "pallas_tpu")
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "pallas_tpu")
ADMISSION_ORDERS = ("fcfs", "affinity")
BASELINE_KINDS = ("padded_slots", "separate")


@dataclasses.dataclass(frozen=True)
class AdapterMemoryBaseline:
    """A benchmark baseline that gives adapters memory apart from the unified pool. Only bench/
    selects one; the engine's own design is the unified pool (`EngineConfig.baseline=None`).

    "padded_slots": `size` adapter slots, each sized at max_lora_rank on every target module, the
    rest of the pool KV; every LoRA step runs over all slots at max_lora_rank (vLLM's --max-loras).
    "separate": `size` pages for adapters at their real ranks, the rest KV."""
    kind: str
    size: int

    def __post_init__(self):
        if self.kind not in BASELINE_KINDS:
            raise ValueError(f"baseline kind must be one of {BASELINE_KINDS}, got {self.kind!r}")
        _positive_int("baseline size", self.size)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # -- the unified page pool ------------------------------------------------------------------
    page_size: int = 16                      # vectors per page; 1 is S-LoRA's token-granular pool
    gpu_memory_utilization: float = 0.9      # share of the device's total memory the engine may use
    pool_pages: int | None = None            # an exact pool size; overrides gpu_memory_utilization
    enable_prefix_caching: bool = True       # share full KV pages of equal prefixes (same adapter version)
    # -- batching -------------------------------------------------------------------------------
    max_num_seqs: int = 64                   # running requests
    max_num_batched_tokens: int = 2048       # tokens a prefill step; longer prompts are chunked
    # -- adapters -------------------------------------------------------------------------------
    max_loras: int = 64                      # distinct adapters in the running batch (S-LoRA's cap)
    max_lora_rank: int = 64
    max_cpu_loras: int = 256                 # adapter files whose rows stay in host memory
    max_cpu_lora_gb: float | None = None     # GiB those rows may take; None: 40% of host memory
    # -- S-LoRA's scheduling policies -----------------------------------------------------------
    admission_order: str = "fcfs"            # "fcfs", or "affinity": adapters already read first
    max_wait_s: float = 1.0                  # a request waiting longer goes first, whatever the order
    early_abort_ttft: float | None = None    # seconds; abort a queued request that cannot meet it
    prefetch_adapters: int = 8               # adapters paged in per step ahead of use; 0: off
    # -- execution ------------------------------------------------------------------------------
    lora_backend: str = "auto"               # "auto" picks per step (slora_jax.lora.select)
    attention_backend: str = "auto"          # "auto": "pallas" on a GPU, "xla" elsewhere
    async_scheduling: bool | None = None     # dispatch step n+1 before waiting for step n; None: off only on a CPU
    tensor_parallel_size: int = 1
    compilation_cache_dir: str | None = os.path.expanduser("~/.cache/slora_jax/xla")
    # -- benchmark baselines only ---------------------------------------------------------------
    baseline: AdapterMemoryBaseline | None = None

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                     "max_cpu_loras", "tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.pool_pages is not None:
            _positive_int("pool_pages", self.pool_pages)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_cpu_lora_gb is not None and not self.max_cpu_lora_gb > 0:
            raise ValueError(f"max_cpu_lora_gb must be > 0 or None, got {self.max_cpu_lora_gb!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s!r}")
        if self.early_abort_ttft is not None and not self.early_abort_ttft > 0:
            raise ValueError(f"early_abort_ttft must be > 0 seconds or None, got {self.early_abort_ttft!r}")
        if isinstance(self.prefetch_adapters, bool) or not isinstance(self.prefetch_adapters, int) \
                or self.prefetch_adapters < 0:
            raise ValueError(f"prefetch_adapters must be an integer >= 0, got {self.prefetch_adapters!r}")
        _one_of("admission_order", self.admission_order, ADMISSION_ORDERS)
        _one_of("lora_backend", self.lora_backend, LORA_BACKENDS)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.baseline is not None and not isinstance(self.baseline, AdapterMemoryBaseline):
            raise ValueError(f"baseline must be an AdapterMemoryBaseline or None, got {self.baseline!r}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
