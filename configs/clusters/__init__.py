"""Clusters the expert-parallel projections assume (experiments/ep_bench): stated bandwidths, not
measurements. One `get_config()` file per set of clusters."""
