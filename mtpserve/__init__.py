"""mtpserve: an inference engine for DeepSeek-style multi-token-prediction speculative decoding."""
import os

from mtpserve.sampling_params import SamplingParams


def default_model_path() -> str:
    """The shipped default checkpoint's directory (an ordinary HF DeepSeek-V3 checkpoint)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def __getattr__(name):  # LLM pulls in torch and the model: import it lazily
    if name == "LLM":
        from mtpserve.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "default_model_path"]
