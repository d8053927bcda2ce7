"""slora-jax: S-LoRA in JAX. One base model, thousands of LoRA adapters, one unified page pool."""

from slora_jax.config import AdapterMemoryBaseline, EngineConfig
from slora_jax.llm import LLM
from slora_jax.request import CompletionOutput, LoRARequest, RequestOutput
from slora_jax.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "EngineConfig",
           "AdapterMemoryBaseline"]
