"""LoRA adapters on one base model: what names them (request.py), reading PEFT folders (peft.py), and the engine's
registry, host cache and device slots (manager.py). The per-token math on the device is models/lora.py."""
