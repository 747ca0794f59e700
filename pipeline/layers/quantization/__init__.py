"""Quantized linears and KV cache: which mode swaps which layer, and each mode's weights and products."""
