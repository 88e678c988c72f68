"""Expert parallelism on a JAX device mesh: the mesh, where each parameter lives on it, per-rank
routing statistics and expert placement (the dispatch itself is `pallas_kernels.expert_parallel`)."""
