"""Where a model named on the command line is: a local folder or .gguf file, or a Hugging Face repository
downloaded once. Light (no JAX), so that `capstan serve` finds the checkpoint before it imports the runtime."""

from __future__ import annotations

from pathlib import Path

from .config import UnsupportedModelError


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def resolve_checkpoint(model: str | Path) -> Path:
    """A local folder or .gguf file as is; hf://org/name[@revision] downloaded (or found in the cache)."""
    text = str(model)
    if text.startswith("hf://"):
        repo, _, revision = text[len("hf://") :].partition("@")
        from huggingface_hub import snapshot_download

        try:
            return Path(
                snapshot_download(
                    repo, revision=revision or None, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
                )
            )
        except Exception as e:  # no network, no such repo, gated: say which and why
            raise UnsupportedModelError(f"model {text}: download failed: {type(e).__name__}: {e}") from None
    path = Path(text)
    if not (path.is_dir() or is_gguf(path)):
        raise UnsupportedModelError(f"model {text}: no such checkpoint folder or .gguf file (or use hf://org/name)")
    return path
