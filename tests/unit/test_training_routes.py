"""The training-loop endpoints exist only when asked for (--enable-weight-updates, --enable-sleep-mode, or vLLM's
VLLM_SERVER_DEV_MODE=1), and their bodies are checked before anything reaches the engine."""
from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.api_server import add_serve_args
from tokenloom.entrypoints.openai.app import ServerSettings, build_app

WEIGHT_PATHS = ["/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
                "/destroy_weights_update_group", "/pause_generation", "/continue_generation"]
SLEEP_PATHS = ["/sleep", "/wake_up"]


def client(**settings) -> TestClient:
    # An engine object that is not started: enough to build the app and route requests.
    return TestClient(build_app(AsyncLLM(EngineConfig(), served_model_name="m"),
                                ServerSettings(served_model_names=["m"], **settings)))


def parse(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(["smollm2-135m-instruct", *argv])


def test_the_endpoints_are_closed_by_default():
    with client() as c:
        for path in WEIGHT_PATHS + SLEEP_PATHS:
            assert c.post(path, json={}).status_code == 404, path
        assert c.get("/is_sleeping").status_code == 404


def test_weight_updates_open_only_the_weight_endpoints():
    with client(enable_weight_updates=True) as c:
        assert c.post("/update_weights_from_disk", json={}).status_code == 400  # open: the body is checked
        assert c.post("/sleep").status_code == 404


@pytest.mark.parametrize("flags, attr", [(["--enable-weight-updates"], "enable_weight_updates"),
                                         (["--enable-sleep-mode"], "enable_sleep_mode")])
def test_each_flag_parses(flags, attr):
    assert getattr(parse(*flags), attr) is True and getattr(parse(), attr) is False


@pytest.mark.parametrize("body, param", [
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[2], [3]]}, "names"),
    ({"names": ["a"], "dtypes": ["int8"], "shapes": [[2]]}, "dtypes"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[2, -1]]}, "names"),
])
def test_a_tensor_list_that_does_not_add_up_is_a_400(body, param):
    with client(enable_weight_updates=True) as c:
        response = c.post("/update_weights_from_distributed", json=body)
    assert response.status_code == 400
    assert param in response.text


def test_a_sleep_level_other_than_1_or_2_is_a_400():
    with client(enable_sleep_mode=True) as c:
        assert c.post("/sleep?level=3").status_code == 400
