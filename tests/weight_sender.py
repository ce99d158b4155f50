"""A trainer process for the weight-sync tests: builds a tiny random model and broadcasts its weights.

    python tests/weight_sender.py PORT WORLD_SIZE KIND SEED
"""
from __future__ import annotations

import sys

import helpers

from tokenloom.distributed.weight_sync import WeightSender


def main() -> None:
    port, world_size, kind, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    model = helpers.build_tiny_model(kind, seed=seed) if kind in helpers.TINY_VARIANTS else None
    if model is None:
        model = helpers.build_tp3_model(seed)
    sender = WeightSender("127.0.0.1", port, world_size)
    for tensor in model.state_dict().values():
        sender.send(tensor)


if __name__ == "__main__":
    main()
