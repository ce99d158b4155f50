"""Bounds on what a chat template may compute, in the sandbox and in the render process.

The sandbox refuses, before computing them, integers over MAX_INT_BITS, padding widths and %-format
widths over MAX_RENDER_CHARS and replacements that would outgrow it; the render process (templates sent
with a request) is killed past its time limit and cannot allocate past its memory limit, and the next
render works.
"""
from __future__ import annotations

import time
import tracemalloc

import pytest

from tokenloom.tokenizer.chat_template import ChatTemplateError, render_chat_template
from tokenloom.tokenizer.template_process import TemplateProcess

MESSAGES = [{"role": "user", "content": "hi"}]

REFUSED = [
    "{% set a = (7**1024)**1024 %}x",  # 2.9 million bits: 30 s of GIL-holding C arithmetic on main
    "{{ (2**4000) * (2**4000) }}",
    "{% set ns = namespace(a=7) %}{% for i in range(64) %}{% set ns.a = ns.a * ns.a %}{% endfor %}x",
    "{{ '%300000000s' % 'a' }}",
    "{{ '%.300000000f' % 1.0 }}",
    "{{ '%*s' % (300000000, 'a') }}",
    "{{ 'a'.center(300000000) }}",
    "{{ 'a'.ljust(300000000) }}",
    "{{ 'a'.zfill(300000000) }}",
    "{{ 'a'|center(300000000) }}",
    "{{ 'a\nb'|indent(300000000) }}",
    "{{ '%300000000s'|format('a') }}",
    "{{ ('x' * 4000000).replace('x', 'yy') }}",
]


# Done, the costliest of these takes 30 s of arithmetic or 300 MB of text; refused first, a render costs
# milliseconds and a few kB. The bounds sit far from both, so a loaded machine cannot fail them.
REFUSED_WITHIN_SECONDS = 5.0
REFUSED_WITHIN_BYTES = 32 * 2 ** 20


@pytest.mark.parametrize("template", REFUSED)
def test_oversized_work_is_refused_before_it_is_done(template):
    tracemalloc.start()
    t0 = time.time()
    try:
        with pytest.raises(ChatTemplateError):
            render_chat_template(template, MESSAGES)
        elapsed = time.time() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < REFUSED_WITHIN_SECONDS and peak < REFUSED_WITHIN_BYTES, (elapsed, peak)


@pytest.mark.parametrize("template,expected", [
    ("{{ 2**64 * 3 }}", str(2 ** 64 * 3)),
    ("{{ '%5s|%-3d|%.2f' % ('ab', 7, 1.5) }}", "   ab|7  |1.50"),
    ("{{ 'ab'.center(6) }}|", "  ab  |"),
    ("{{ 'a b'.replace(' ', '--') }}", "a--b"),
    ("{{ messages[0].content|indent(2, true) }}", "  hi"),
    ("{{ '%s!'|format(messages[0].content) }}", "hi!"),
])
def test_ordinary_template_arithmetic_still_works(template, expected):
    assert render_chat_template(template, MESSAGES) == expected


@pytest.fixture(scope="module")
def proc():
    p = TemplateProcess(timeout=1.0)
    yield p
    p.close()


def test_render_process_renders(proc):
    assert proc.render("{{ messages[0].content }}!", MESSAGES) == "hi!"


def test_render_process_is_killed_past_its_time_and_replaced(proc):
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    t0 = time.time()
    with pytest.raises(ChatTemplateError, match="longer than"):
        proc.render(slow, MESSAGES)
    # the loop would run for hours: ended at the 1 s limit, with 10 s for a loaded machine to kill and answer
    assert time.time() - t0 < proc.timeout + 10
    assert proc.render("{{ messages[0].content }}?", MESSAGES) == "hi?"


def test_render_process_cannot_allocate_past_its_limit(proc):
    grow = "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}x"
    with pytest.raises(ChatTemplateError):
        proc.render(grow, MESSAGES)
    assert proc.render("{{ messages|length }}", MESSAGES) == "1"
