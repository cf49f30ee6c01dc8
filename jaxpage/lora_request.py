"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request: ``lora_name`` names it (over HTTP it is the
    ``model``), ``lora_int_id`` is a positive integer unique per adapter, and
    ``lora_path`` the directory holding ``adapter_config.json`` and
    ``adapter_model.safetensors``.

    Two requests with the same ``lora_name`` share the adapter loaded first under that
    name (remove it with ``LLMEngine.remove_lora`` to load another in its place).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an integer >= 1")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path={self.lora_path!r} must be a string")
