"""Which decode batch sizes are captured as CUDA graphs, and how a step is padded to one (CPU-testable logic;
the capture itself is tested in tests/gpu)."""
from tokenloom.model.layers.attention_backend import ScheduledSpan
from tokenloom.model.layers.attention_flashinfer import paged_kv_layout
from tokenloom.worker.cuda_graphs import capture_sizes, pad_spans, padded_size


def test_default_ladder_is_exact_for_small_batches_and_every_eight_above():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_ladder_always_ends_at_the_largest_batch():
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]


def test_given_sizes_are_kept_up_to_the_largest_batch():
    assert capture_sizes(16, [32, 8, 1, 8, 3]) == [1, 3, 8]


def test_a_step_is_padded_to_the_next_captured_size():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 64)] == [1, 4, 8, 16, 64]
    assert padded_size(65, sizes) is None


def test_padding_rows_attend_one_token_of_the_scratch_block():
    spans = [ScheduledSpan(0, 7, 1, [3, 9]), ScheduledSpan(1, 2, 1, [5])]
    padded = pad_spans(spans, 4, scratch_block=99)
    layout = paged_kv_layout(padded, block_size=4)
    assert [s.first_row for s in padded] == [0, 1, 2, 3]
    assert layout.kv_indices.tolist() == [3, 9, 5, 99, 99]
    assert layout.last_page_len.tolist() == [4, 3, 1, 1]
