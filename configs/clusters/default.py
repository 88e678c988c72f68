"""An 8-GPU node, the same GPUs as two nodes of four, and an 8-chip TPU slice, with their makers'
stated bandwidths (per device, one direction); the collective latencies are assumed orders of
magnitude, not measured. Override a field on the command line, e.g.
`--clusters.h100_node.link_gbps=400`."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    dict(
      h100_node=dict(
        name="8x H100 SXM, NVLink",
        ranks=8,
        ranks_per_node=8,
        hbm_gbps=3350.0,  # HBM3
        link_gbps=450.0,  # NVLink 4: 900 GB/s both directions
        cross_node_gbps=450.0,
        collective_latency_us=10.0,
        fixed_ms=0.0,
      ),
      h100_two_nodes=dict(
        name="2 nodes x 4 H100, IB",
        ranks=8,
        ranks_per_node=4,
        hbm_gbps=3350.0,
        link_gbps=450.0,
        cross_node_gbps=50.0,  # 400 Gb/s InfiniBand NDR a GPU
        collective_latency_us=20.0,
        fixed_ms=0.0,
      ),
      tpu_v5e_8=dict(
        name="TPU v5e 2x4 slice, ICI",
        ranks=8,
        ranks_per_node=8,
        hbm_gbps=819.0,
        link_gbps=100.0,  # ICI: 1600 Gb/s a chip over its links
        cross_node_gbps=100.0,
        collective_latency_us=5.0,
        fixed_ms=0.0,
      ),
    )
  )
