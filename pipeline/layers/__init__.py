"""What a step computes with: attention over the paged KV cache (attention/, one backend a
device: cpu with the C kernels, varlen with FlashAttention or SDPA), the KV cache itself
(kv_cache.py, quantization/int8_kv_cache.py for its int8 form), linear layers (packed_linear.py) and their
quantization (quantization.py), and sampling with its logits processing (sampler.py,
top_tokens.py, grammar_masks.py for structured outputs' masks).
"""
