"""Routing analysis, the maximum-entropy (IPF) model of unique experts, and the cost model."""
