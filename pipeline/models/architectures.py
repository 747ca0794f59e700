"""The model families the engine runs: Hugging Face architecture names to our module classes
(encoders, which only embed, run on transformers' own modules: engine/encoder_engine.py)."""
from pipeline.models.llama import LlamaForCausalLM
from pipeline.models.model_dir import ENCODER_ARCHITECTURES

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
                         f"{', '.join(sorted(ARCHITECTURES))} (and, for embeddings only, "
                         f"{', '.join(ENCODER_ARCHITECTURES)})") from None
