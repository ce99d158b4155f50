"""`tokenloom bench vision` times both towers on shared weights and reports how far apart their outputs are."""
from __future__ import annotations

import argparse
import json

from tokenloom.bench.vision_tower import add_vision_args


def test_the_vision_bench_reports_both_towers_and_their_outputs_agree(tmp_path):
    parser = argparse.ArgumentParser()
    add_vision_args(parser)
    out = tmp_path / "vision.json"
    ns = parser.parse_args(["--depth", "1", "--image-size", "56x28", "--repeats", "1", "--device", "cpu",
                            "--json", str(out)])
    assert ns.func(ns) == 0
    results = json.loads(out.read_text())
    assert set(results["images_per_second"]) == {"tokenloom", "transformers"}
    assert results["patches_per_call"] == 8
    assert results["max_abs_difference"] < 1e-4
