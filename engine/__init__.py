"""A minimal paged-KV inference engine for Llama-family models."""

from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM, GenerationResult
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "EngineConfig",
    "GenerationResult",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
