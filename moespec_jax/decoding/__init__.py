"""Decoding: sampling filters, generation parameters, the jitted generation loop."""
