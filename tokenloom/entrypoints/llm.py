"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(conversations, params)`."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from PIL import Image
from tqdm import tqdm

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.pooling import PoolingConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.engine.input_processor import InputProcessor
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.weight_control import WeightControlError
from tokenloom.executor.base import WorkerCallError
from tokenloom.model.pooling_config import truncate
from tokenloom.multimodal.chat_parts import ImageRef, split_image_parts
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.image_source import image_bytes
from tokenloom.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from tokenloom.profiler import PROFILER
from tokenloom.tokenizer import Tokenizer
from tokenloom.worker.messages import WorkerArg

# Text, token ids, or vLLM's dict form: {"prompt": text or "prompt_token_ids": ids, "multi_modal_data":
# {"image": a PIL image or a list of them}}.
Prompt = str | list[int] | dict[str, object]
# One adapter for every prompt, or one (or None: the base model) per prompt, as vLLM takes it.
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """Runs an EngineCore in this process. Engine options are keyword arguments (see EngineConfig)."""

    def __init__(self, model: str | None = None, progress: bool = True, **engine_args):
        if model is not None:
            engine_args["model"] = model
        self.config = EngineConfig.from_kwargs(**engine_args)
        if self.config.parallel.data_parallel_size > 1:
            raise ConfigError(f"data_parallel_size {self.config.parallel.data_parallel_size}: LLM runs one engine in "
                              f"this process; serve replicas with `tokenloom serve --data-parallel-size N` (or start "
                              f"one LLM per process)")
        self.engine = EngineCore(self.config, progress=progress)
        info = self.engine.info
        self.tokenizer = Tokenizer.from_model_path(info.model_path)
        self.input_processor = InputProcessor(self.tokenizer, self.config, info.max_model_len, info.vocab_size,
                                              info.eos_token_ids, model_path=info.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the workers (with tensor_parallel_size > 1 they are processes of their own)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None, lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order. `lora_request`: the LoRA adapter
        to run with (the engine needs enable_lora=True)."""
        prompts = _as_list(prompts)
        ids = self._add(prompts, sampling_params, priority, lora_request)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        tokens, start = 0, time.perf_counter()
        try:
            for out in self._run():
                if out.finished:
                    finished[out.request_id] = out
                    tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} output tok/s")
        finally:
            bar.close()
        return [finished[i] for i in ids]

    @property
    def pooling(self) -> PoolingConfig | None:
        """Set when this engine embeds (an encoder, or --runner pooling / --convert embed); None: it generates."""
        return self.engine.info.pooling

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in input order, batched by the scheduler like any
        request (each one prefill); `dimensions` truncates where the model allows it (Matryoshka)."""
        pooling = self.pooling
        if pooling is None:
            raise ValueError("this model generates: embeddings need an embedding model (e.g. all-minilm-l6-v2) "
                             "or runner='pooling' / convert='embed'")
        problem = pooling.check_dimensions(dimensions)
        if problem:
            raise ValueError(problem)
        prompts = _as_list(prompts)
        ids = self._add(prompts, SamplingParams(max_tokens=1, embed=True), None)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Embedding", unit="input", disable=not use_tqdm)
        try:
            for out in self._run():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
        return [EmbeddingRequestOutput(i, finished[i].prompt_token_ids,
                                       EmbeddingOutput(truncate(finished[i].embedding, dimensions, pooling)))
                for i in ids]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        lora_request: LoRAArg = None) -> Iterator[RequestOutput]:
        """Yield cumulative RequestOutputs as tokens arrive, for all prompts interleaved."""
        self._add(_as_list(prompts), sampling_params, None, lora_request)
        yield from self._run()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams |
             Sequence[SamplingParams] | None = None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.input_processor.image_processor
        image_text = processor.image_text if processor is not None else None
        split = [split_image_parts(conv, image_text) for conv in conversations]
        conversations, images = [c for c, _ in split], [refs for _, refs in split]
        for refs in images:
            self.input_processor.check_image_count(len(refs))
        prompts = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      chat_template=chat_template, tools=tools,
                                                      **(chat_template_kwargs or {}))
                   for conv in conversations]
        prompt_ids = [{"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False),
                       "multi_modal_data": {"image": [self._load_image(ref) for ref in refs]}}
                      for p, refs in zip(prompts, images)]
        outputs = self.generate(prompt_ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    # ---- serving inside a training loop (docs/training.md) -------------------------------------------------
    def update_weights(self, named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Serve these weights: every tensor of the model, named as in its Hugging Face checkpoint (a trainer's
        `model.named_parameters()`); a set that does not fit raises and the old weights keep serving."""
        self.engine.update_weights(dict(named_tensors))

    def update_weights_from_disk(self, path: str) -> None:
        """Serve the weights at `path`: a folder or GGUF of the same architecture and shapes."""
        self.engine.update_weights_from_disk(path)

    def collective_rpc(self, method: str, args: tuple[WorkerArg, ...] = ()) -> None:
        """Call a worker method on every rank (those of tokenloom.worker.messages.WORKER_METHODS: the weight
        updates, the weight-sync group, sleep and wake); raises what rank 0 raised."""
        self.engine.drain()
        try:
            self.engine.executor.collective_rpc(method, *args)
        except WorkerCallError as exc:
            raise WeightControlError(str(exc)) from None

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the weights too (level 2) until `wake_up()`."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def _add(self, prompts: list[Prompt], params, priority, lora_request: LoRAArg = None) -> list[str]:
        if self.engine.is_sleeping():
            raise WeightControlError("the engine is asleep: call wake_up() first")
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        loras = _loras_for(lora_request, len(prompts))
        for lora in {lora for lora in loras if lora is not None}:
            self.engine.loras.check(lora)
        embeds = self.pooling is not None
        if any(p.embed != embeds for p in params_list):
            raise ValueError("this model embeds: use LLM.embed()" if embeds else
                             "this model generates: embedding requests need an embedding model")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            rid = str(next(self._ids))
            text, images = _prompt_parts(prompt)
            req = self.input_processor.process(rid, text, p, priority[i] if priority else 0, images=images)
            req.lora_request = loras[i]
            requests.append((req, text))
        ids = []
        for req, prompt in requests:  # validate all first, so one bad prompt adds nothing
            self.output_processor.add_request(req.request_id, prompt if isinstance(prompt, str) else None,
                                              req.prompt_token_ids, req.sampling_params)
            self.engine.add_request(req)
            ids.append(req.request_id)
        return ids

    def _load_image(self, ref: ImageRef) -> Image.Image:
        if isinstance(ref, Image.Image):
            return ref
        processor = self.input_processor.image_processor
        if processor is None:
            raise ImageInputError("this model reads no images (a text-only model); send text only")
        return processor.decode(image_bytes(ref, self.config.multimodal))

    def _run(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            step_outputs = self.engine.step()
            with PROFILER.section("detokenize"):
                outputs, to_abort = self.output_processor.process_outputs(step_outputs)
            if to_abort:
                self.engine.abort_requests(to_abort)
            yield from outputs

    def abort(self, request_id: str) -> None:
        self.engine.abort_requests([request_id])
        self.output_processor.abort(request_id)


def _loras_for(lora_request: LoRAArg, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {n} prompts but {len(loras)} LoRA requests")
    return loras


def _prompt_parts(prompt: Prompt) -> tuple[str | list[int], list[Image.Image]]:
    """A prompt's text (or ids) and its images."""
    if not isinstance(prompt, dict):
        return prompt, []
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if not isinstance(text, (str, list)):
        raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids'")
    unknown = set((prompt.get("multi_modal_data") or {})) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: unsupported modality {', '.join(sorted(unknown))} (supported: image)")
    images = (prompt.get("multi_modal_data") or {}).get("image", [])
    images = [images] if isinstance(images, Image.Image) else list(images)
    if any(not isinstance(im, Image.Image) for im in images):
        raise ValueError("multi_modal_data['image'] takes PIL images")
    return text, images


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)
