"""Paged attention: the plain-XLA reference defines correctness; faster kernels are chosen by backend."""
from .metadata import INVALID_SLOT, AttentionMetadata
from .reference import paged_attention, write_kv

__all__ = ["INVALID_SLOT", "AttentionMetadata", "paged_attention", "write_kv"]
