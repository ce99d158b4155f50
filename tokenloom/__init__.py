"""tokenloom: an LLM inference and serving engine on PyTorch."""
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from tokenloom.entrypoints.llm import LLM  # lazy: LLM imports torch and the model code
        return LLM
    if name == "LogitsProcessor":
        from tokenloom.model.logits_processor import LogitsProcessor  # lazy: it imports torch
        return LogitsProcessor
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "LogitsProcessor", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]
