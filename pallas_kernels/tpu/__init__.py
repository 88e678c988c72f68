"""The Pallas TPU (Mosaic) kernels of the routed expert FFN: deduplicated and per-slot (`moe_ffn.py`)."""

from pallas_kernels.tpu.moe_ffn import dedup_rows, expert_ffn_tpu, per_slot_rows

__all__ = ["dedup_rows", "expert_ffn_tpu", "per_slot_rows"]
