"""LoRA backends: plan on the host, apply on the device, and their selection."""
