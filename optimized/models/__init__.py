"""Model code: one decoder (``decoder.CausalLM``) for the Qwen3, Qwen2 and Llama families."""

from optimized.models.config import FAMILIES, ModelConfig, load_config, parse_config
from optimized.models.decoder import AttentionContext, CausalLM

__all__ = ["FAMILIES", "AttentionContext", "CausalLM", "ModelConfig", "load_config", "parse_config"]
