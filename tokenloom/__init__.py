"""tokenloom: an LLM inference and serving engine on PyTorch."""
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from tokenloom.entrypoints.llm import LLM  # lazy: LLM imports torch and the model code
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
