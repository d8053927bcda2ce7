"""LoRA over the unified pool: the backends (plan on the host, apply on the device) and their
selection. The engine reaches the kernels only through these names."""

from slora_jax.lora.backends import (BACKENDS, LoraBackend, PallasBackend, RanksplitBackend, XlaBackend,
                                     get_backend, plan, pool_lora, ranksplit_tables)
from slora_jax.lora.inputs import QKV, LoraInputs, qkv_group, rows_needed, shrink_launches, stack_qkv
from slora_jax.lora.selection import (GPU_THRESHOLDS, check_backend, hybrid_slots, select, slot_bucket,
                                   step_backend, whole_rows_layout)
from slora_jax.lora.xla import lora_xla, lora_xla_expand, lora_xla_shrink

__all__ = ["BACKENDS", "GPU_THRESHOLDS", "LoraBackend", "LoraInputs", "PallasBackend", "QKV", "RanksplitBackend",
           "XlaBackend", "check_backend", "get_backend", "hybrid_slots", "lora_xla", "lora_xla_expand",
           "lora_xla_shrink", "plan", "pool_lora", "qkv_group", "ranksplit_tables", "rows_needed", "select",
           "shrink_launches", "slot_bucket", "stack_qkv", "step_backend", "whole_rows_layout"]
