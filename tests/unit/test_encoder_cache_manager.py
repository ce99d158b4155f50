"""The scheduler's encoder cache account: room, holds, least-recently-used eviction and the per-step budget."""
from __future__ import annotations

import pytest

from tokenloom.config import ConfigError, MultiModalConfig
from tokenloom.core.multimodal import ImageInput
from tokenloom.scheduler.encoder_cache import EncoderCacheManager, run_over_whole_images


def _image(h: str, offset: int, length: int = 16, attend_whole: bool = False) -> ImageInput:
    return ImageInput(content_hash=h, pixel_values=b"", shape=[3, 28, 28], offset=offset, length=length,
                      attend_whole=attend_whole)


def test_a_chunk_stops_before_an_image_the_cache_has_no_room_for():
    cache = EncoderCacheManager(capacity=16, step_budget=64)
    assert cache.fit_chunk("a", [_image("x", 2)], 0, 20) == 20
    assert cache.fit_chunk("b", [_image("y", 5)], 0, 20) == 5  # x is still held by a


def test_a_cached_image_costs_no_room_for_another_request():
    cache = EncoderCacheManager(capacity=16, step_budget=64)
    cache.fit_chunk("a", [_image("x", 2)], 0, 20)
    cache.begin_step()
    assert cache.fit_chunk("b", [_image("x", 7)], 0, 30) == 30


def test_an_image_nobody_holds_is_evicted_for_a_new_one_and_the_workers_are_told():
    cache = EncoderCacheManager(capacity=16, step_budget=64)
    image = _image("x", 2)
    cache.fit_chunk("a", [image], 0, 20)
    cache.release_past("a", [image], 20)
    cache.begin_step()
    assert cache.fit_chunk("b", [_image("y", 0)], 0, 16) == 16
    assert cache.take_frees() == ["x"]
    assert cache.take_frees() == []


def test_an_image_is_held_until_its_placeholders_are_computed():
    cache = EncoderCacheManager(capacity=16, step_budget=64)
    image = _image("x", 2)
    cache.fit_chunk("a", [image], 0, 10)
    cache.release_past("a", [image], 10)  # 8 of its 16 rows still to come
    cache.begin_step()
    assert cache.fit_chunk("b", [_image("y", 0)], 0, 16) == 0


def test_one_step_encodes_no_more_than_its_budget_beyond_the_first_image():
    cache = EncoderCacheManager(capacity=100, step_budget=20)
    assert cache.fit_chunk("a", [_image("x", 0)], 0, 16) == 16
    assert cache.fit_chunk("b", [_image("y", 3)], 0, 19) == 3
    cache.begin_step()
    assert cache.fit_chunk("b", [_image("y", 3)], 3, 16) == 16


def test_a_chunk_ending_inside_a_whole_image_runs_on_to_its_end_when_the_limit_allows():
    image = _image("x", 4, attend_whole=True)  # placeholders 4..19
    assert run_over_whole_images([image], 0, 10, 64) == 20
    assert run_over_whole_images([image], 0, 10, 19) == 10  # no room: fit_chunk then stops before it
    assert run_over_whole_images([_image("y", 4)], 0, 10, 64) == 10  # an image that may be split


def test_a_chunk_never_ends_inside_a_whole_image():
    cache = EncoderCacheManager(capacity=64, step_budget=64)
    image = _image("x", 4, attend_whole=True)
    assert cache.fit_chunk("a", [image], 0, 10) == 4  # stops before it
    assert cache.fit_chunk("a", [image], 4, 10) == 0  # at its start, without room for all of it: waits
    assert cache.fit_chunk("a", [image], 4, 16) == 16


def test_with_no_capacity_an_image_is_freed_when_the_next_step_begins_and_never_refused():
    cache = EncoderCacheManager(capacity=0, step_budget=8)
    assert cache.fit_chunk("a", [_image("x", 2)], 0, 20) == 20
    assert cache.fit_chunk("b", [_image("x", 2)], 0, 20) == 20
    assert cache.take_frees() == []
    cache.begin_step()
    assert cache.take_frees() == ["x"]


def test_a_negative_encoder_cache_is_refused_and_zero_means_no_reuse():
    assert MultiModalConfig(max_encoder_cache=0).max_encoder_cache == 0
    with pytest.raises(ConfigError, match="max_encoder_cache must be >= 0"):
        MultiModalConfig(max_encoder_cache=-1)
