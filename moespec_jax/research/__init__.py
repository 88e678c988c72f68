"""The research harness: benches, cost-model validation, timing rounds, reports, projections, the
demo. It uses the core (`moespec_jax`) through its public modules; the core never imports it."""
