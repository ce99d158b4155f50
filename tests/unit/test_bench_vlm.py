"""`tokenloom bench vlm` at tiny shapes: TTFT with the encoder cache on and off and transformers' beside them,
and images/s through both towers."""
from __future__ import annotations

import argparse
import json

from tokenloom.bench.vlm_serving import add_vlm_args


def test_the_vlm_bench_reports_ttft_per_cache_mode_and_concurrency_beside_transformers_with_one_first_token(
        tmp_path):
    parser = argparse.ArgumentParser()
    add_vlm_args(parser)
    out = tmp_path / "vlm.json"
    ns = parser.parse_args(["--tiny", "--image-size", "56x56", "--words", "10", "--concurrency", "1", "2",
                            "--repeats", "1", "--device", "cpu", "--json", str(out)])
    assert ns.func(ns) == 0
    results = json.loads(out.read_text())
    assert set(results["ttft_s"]) == {"on", "off", "transformers"}
    assert all(set(by_c) == {"1", "2"} and all(s > 0 for s in by_c.values()) for by_c in results["ttft_s"].values())
    assert (results["patches"], results["image_tokens"], results["prompt_tokens"]) == (16, 4, 17)
    assert results["first_tokens"]["tokenloom"] == results["first_tokens"]["transformers"]
    assert len(results["first_tokens"]["tokenloom"]) == 1
    assert set(results["encoder_images_per_second"]) == {"tokenloom", "transformers"}
