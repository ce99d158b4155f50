"""Prompt sets for `tokenloom bench serve`: random, shared-prefix, repetitive, jsonl and ShareGPT.

Prompts are built from common English words picked at random, one word being about one
token for most BPE tokenizers. ``tokens_per_word`` (measured against the server's
/tokenize by the caller when it can) turns a target token count into a word count, so
the prompt lengths come out close to what was asked. The real counts are whatever the
server reports in ``usage``; the benchmark reports those.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

# Frequent lower-case words; each is a single token (with its leading space) in common
# BPE vocabularies, which keeps token counts predictable.
WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his her they this had not are but
which have one were all their there been has when who will more no if out so said what
up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those
people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old
year off come since against go came right used take three place small found part
general house number water room hand high light line mind point group name word order
fact case world power town music school early body story family city land week food
money game book war head side water field half line table door black white free green
open best short river home paper letter night area report back face plan road sea show
""".split()))


@dataclass
class BenchPrompt:
    """One request of a benchmark. ``prefix`` is the shared part (the system message on
    the chat endpoint, the start of the prompt on completions)."""
    prompt: str
    output_len: int
    input_len: int  # the intended number of tokens of prefix + prompt (an estimate)
    prefix: str = ""
    group: int | None = None
    extra: dict = field(default_factory=dict)

    def completion_prompt(self) -> str:
        return self.prefix + self.prompt

    def chat_messages(self) -> list[dict]:
        messages = []
        if self.prefix:
            messages.append({"role": "system", "content": self.prefix.strip()})
        messages.append({"role": "user", "content": self.prompt.strip()})
        return messages


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """``n`` integers drawn uniformly from [mean*(1-r), mean*(1+r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(round(mean * (1 - range_ratio))))
    hi = max(lo, int(round(mean * (1 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_text(rng: random.Random, num_tokens: int, tokens_per_word: float = 1.0) -> str:
    """About ``num_tokens`` tokens of random words, each with a leading space."""
    if num_tokens <= 0:
        return ""
    words = max(1, int(round(num_tokens / max(tokens_per_word, 1e-6))))
    return "".join(" " + rng.choice(WORDS) for _ in range(words))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0, tokens_per_word: float = 1.0) -> list[BenchPrompt]:
    rng = random.Random(seed)
    ins = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    return [BenchPrompt(prompt=random_text(rng, i, tokens_per_word), output_len=o, input_len=i)
            for i, o in zip(ins, outs)]


_NAMES = ("total", "count", "value", "item", "result", "index", "size", "limit", "offset", "score", "weight",
          "price", "amount", "level", "depth", "width", "height", "length", "speed", "rate")
_OPS = ("+", "-", "*")


def _code_snippet(rng: random.Random, lines: int) -> tuple[str, str, str]:
    """A small Python function of about `lines` statements; returns (code, a name in it, a new name)."""
    names = rng.sample(_NAMES, 4)
    func = f"{rng.choice(('compute', 'update', 'merge', 'scale', 'check'))}_{names[0]}"
    body = [f"def {func}({names[1]}, {names[2]}):", f"    {names[3]} = 0"]
    for i in range(lines):
        a, b = rng.sample(names[1:], 2)
        if i % 3 == 2:
            body.append(f"    if {a} > {rng.randint(1, 99)}:")
            body.append(f"        {names[3]} = {names[3]} {rng.choice(_OPS)} {b}")
        else:
            body.append(f"    {a} = {a} {rng.choice(_OPS)} {b} {rng.choice(_OPS)} {rng.randint(1, 9)}")
    body.append(f"    return {names[3]}")
    new = rng.choice([n for n in _NAMES if n not in names])
    return "\n".join(body) + "\n", names[3], new


def repetitive_dataset(num_prompts: int, output_len: int, seed: int = 0, lines: int = 8) -> list[BenchPrompt]:
    """"Repeat this code with one change": a generated Python function, then the start of its copy with one
    variable renamed. The answer mostly repeats the prompt, the workload where n-gram speculation pays
    (vLLM's and llama.cpp's prompt-lookup benchmarks use the same kind of edit-the-code requests)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        code, old, new = _code_snippet(rng, lines)
        prompt = (f"Here is a Python function:\n```python\n{code}```\n\n"
                  f"The same function with the variable `{old}` renamed to `{new}`:\n```python\n")
        out.append(BenchPrompt(prompt=prompt, output_len=output_len, input_len=len(prompt) // 3))
    return out


def shared_prefix_dataset(num_prompts: int, num_groups: int, prefix_len: int, input_len: int, output_len: int,
                          range_ratio: float = 0.0, seed: int = 0,
                          tokens_per_word: float = 1.0) -> list[BenchPrompt]:
    """``num_groups`` prefixes of ``prefix_len`` tokens; request i uses prefix i % num_groups,
    followed by its own random ``input_len`` tokens (so groups are interleaved in arrival order)."""
    if num_groups < 1:
        raise ValueError("--num-groups must be at least 1")
    rng = random.Random(seed)
    prefixes = [random_text(rng, prefix_len, tokens_per_word) for _ in range(num_groups)]
    ins = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for k, (i, o) in enumerate(zip(ins, outs)):
        g = k % num_groups
        out.append(BenchPrompt(prompt=random_text(rng, i, tokens_per_word), output_len=o,
                               input_len=prefix_len + i, prefix=prefixes[g], group=g))
    return out


def jsonl_dataset(path: str, num_prompts: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                  tokens_per_word: float = 1.0, start: int = 0) -> list[BenchPrompt]:
    """One JSON object per line with a "prompt" string; optional "system" (sent as the shared
    prefix / system message) and "output_len" (or "max_tokens"). Lines are taken from line
    ``start`` on, and the file is cycled through when it holds fewer lines than needed."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a "prompt" string')
            rows.append(obj)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    rng = random.Random(seed)
    outs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for k in range(num_prompts):
        obj = rows[(start + k) % len(rows)]
        system = obj.get("system") or ""
        prefix = (system + "\n") if system else ""
        o = obj.get("output_len", obj.get("max_tokens"))
        o = int(o) if o is not None else outs[k]
        est = int(round(len((prefix + obj["prompt"]).split()) * tokens_per_word))
        out.append(BenchPrompt(prompt=obj["prompt"], output_len=o, input_len=est, prefix=prefix))
    return out


def sharegpt_dataset(path: str, num_prompts: int, output_len: int | None = None, seed: int = 0,
                     tokens_per_word: float = 1.3, min_tokens: int = 4, max_prompt_tokens: int = 1024,
                     max_total_tokens: int = 2048) -> list[BenchPrompt]:
    """ShareGPT-format JSON (a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    ...}]}): the first human turn is the prompt, the reply's length is the output length unless
    ``output_len`` is given. Conversations are shuffled with ``seed`` and, as vLLM does, those with a
    prompt or reply under ``min_tokens`` or too long are skipped. Lengths are estimated from words."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations (ShareGPT format)")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in (first, second)):
            continue
        pairs.append((first["value"], second["value"]))
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        if len(out) == num_prompts:
            break
        n_in = max(1, int(round(len(prompt.split()) * tokens_per_word)))
        n_out = output_len or max(1, int(round(len(reply.split()) * tokens_per_word)))
        if n_in < min_tokens or (output_len is None and n_out < min_tokens):
            continue
        if n_in > max_prompt_tokens or n_in + n_out > max_total_tokens:
            continue
        out.append(BenchPrompt(prompt=prompt, output_len=n_out, input_len=n_in))
    if not out:
        raise ValueError(f"{path}: no usable conversations (ShareGPT format: a list of "
                         f'{{"conversations": [{{"from": "human", "value": ...}}, {{"from": "gpt", ...}}]}})')
    if len(out) < num_prompts:
        out = [out[k % len(out)] for k in range(num_prompts)]
    return out
