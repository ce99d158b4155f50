"""Filling a vision encoder from a checkpoint's tensors: which names are the encoder's and what each is called
inside it. Released checkpoints and the ones transformers 5 saves spell some prefixes differently (Gemma 3's
SigLIP is `vision_tower.vision_model.*` in the released files, `vision_tower.*` in a transformers 5 save), so
each encoder lists every spelling it accepts; the text model's tensors match none and are left alone.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from tokenloom.model.model_errors import CorruptModelError

# (checkpoint prefix, prefix inside the encoder), longest checkpoint prefix first where one extends another.
PrefixMap = Sequence[tuple[str, str]]


def encoder_state(tensors: Iterable[tuple[str, torch.Tensor]], prefixes: PrefixMap) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that belong to the encoder, under the encoder's own names."""
    state = {}
    for name, tensor in tensors:
        for outside, inside in prefixes:
            if name.startswith(outside):
                state[inside + name[len(outside):]] = tensor
                break
    return state


def load_encoder_weights(encoder: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], prefixes: PrefixMap) -> None:
    """Copy the checkpoint's tensors into `encoder` (cast to its parameters' dtype), every parameter
    accounted for: a missing or misshapen one is a CorruptModelError naming it."""
    state = encoder_state(tensors, prefixes)
    expected = encoder.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CorruptModelError(f"the checkpoint lacks {len(missing)} vision encoder tensor(s), "
                                f"e.g. {', '.join(missing[:3])}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CorruptModelError(f"the checkpoint has vision tensor(s) this encoder does not know, "
                                f"e.g. {', '.join(unexpected[:3])}")
    wrong = [f"{n} {list(state[n].shape)} (want {list(expected[n].shape)})" for n in expected
             if state[n].shape != expected[n].shape]
    if wrong:
        raise CorruptModelError(f"vision encoder tensor(s) of the wrong shape: {', '.join(wrong[:3])}")
    encoder.load_state_dict(state, strict=True)
