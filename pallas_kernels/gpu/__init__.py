"""The Pallas GPU (Triton) kernels of the routed expert FFN: deduplicated and per-slot (`moe_ffn.py`)."""

from pallas_kernels.gpu.moe_ffn import dedup_rows, expert_ffn_gpu, per_slot_rows

__all__ = ["dedup_rows", "expert_ffn_gpu", "per_slot_rows"]
