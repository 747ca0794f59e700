"""The model families the engine runs: Hugging Face architecture names to our module classes."""
from pipeline.models.llama import LlamaForCausalLM

# Llama-family decoders that differ only in small options (biases, q/k norms, tied embeddings).
ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str):
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}") from None
