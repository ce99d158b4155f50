"""EngineCoreOutputs -> RequestOutputs: detokenize, stop strings, logprobs, n / best_of aggregation."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.core.messages import EngineCoreOutput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tokenloom.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Sequence:
    detok: IncrementalDetokenizer
    output: CompletionOutput
    cumulative_logprob: float = 0.0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    embedding: list[float] | None = None
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        width = max(params.n, params.best_of or params.n)
        seqs = [_Sequence(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.spaces_between_special_tokens, params.stop,
                                                 params.include_stop_str_in_output),
                          CompletionOutput(index=i, text="", token_ids=[],
                                           logprobs=[] if params.logprobs is not None else None))
                for i in range(width)]
        self.requests[request_id] = _RequestState(request_id, prompt, list(prompt_token_ids), params, seqs)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated (cumulative) outputs and the request ids the engine should abort
        because every sequence already stopped on a stop string."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            self._apply(state, out)
            touched[out.request_id] = state
        results = []
        for rid, state in touched.items():
            if state.finished:
                del self.requests[rid]
                if any(s.output.finish_reason == "stop" and isinstance(s.output.stop_reason, str)
                       for s in state.sequences):
                    to_abort.append(rid)
            results.append(self._request_output(state))
        return results, to_abort

    def _apply(self, state: _RequestState, out: EngineCoreOutput) -> None:
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [None if p is None else self._logprobs(p) for p in out.prompt_logprobs]
        state.num_cached_tokens = out.num_cached_tokens
        if out.embedding is not None:
            state.embedding = out.embedding
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params
        seq = state.sequences[out.index]
        if seq.output.finished:
            return
        if out.new_token_ids:
            seq.output.token_ids.extend(out.new_token_ids)
            seq.detok.add_tokens(out.new_token_ids)
            for lp in out.new_logprobs or ():
                seq.cumulative_logprob += lp[0][1]
                if seq.output.logprobs is not None:
                    seq.output.logprobs.append(self._logprobs(lp))
        if seq.detok.stop_reason is not None:
            seq.output.finish_reason, seq.output.stop_reason = "stop", seq.detok.stop_reason
        elif out.finish_reason is not None:
            seq.detok.flush()
            seq.output.finish_reason, seq.output.stop_reason = out.finish_reason, out.stop_reason
        seq.output.text = seq.detok.text
        if state.params.logprobs is not None or state.params.best_of:
            seq.output.cumulative_logprob = seq.cumulative_logprob
        if out.finish_reason is not None and out.arrival_time:
            state.metrics = {"arrival_time": out.arrival_time, "first_scheduled_time": out.first_scheduled_time,
                             "first_token_time": out.first_token_time, "finished_time": out.finished_time}

    def _logprobs(self, entries: list[list[float]]) -> PositionLogprobs:
        result: PositionLogprobs = {}
        for token_id, logprob, rank in entries:
            tid = int(token_id)
            if tid not in result:
                result[tid] = Logprob(logprob, int(rank), self.tokenizer.decode([tid], skip_special_tokens=False))
        return result

    def _request_output(self, state: _RequestState) -> RequestOutput:
        seqs = [s.output for s in state.sequences]
        params = state.params
        if state.finished and params.best_of and params.best_of > params.n:
            ranked = sorted(state.sequences, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
            seqs = [s.output for s in ranked]
        elif len(seqs) > params.n:
            seqs = seqs[: params.n]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, seqs,
                             finished=state.finished, prompt_logprobs=state.prompt_logprobs,
                             num_cached_tokens=state.num_cached_tokens, metrics=dict(state.metrics),
                             embedding=state.embedding, kv_transfer_params=state.kv_transfer_params)
