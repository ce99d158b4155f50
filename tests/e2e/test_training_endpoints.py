"""A real server with --enable-weight-updates --enable-sleep-mode: sleep and wake (503 with Retry-After while
asleep), updates refused with a 400 while the old weights keep serving, an accepted update. What an update
serves is proven against transformers in tests/unit/test_weight_updates.py."""
from __future__ import annotations

import helpers
import pytest

from tests.e2e.server_harness import ServerProcess

pytestmark = pytest.mark.timeout(300)
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "1024", "--num-blocks", "64", "--enable-weight-updates",
                        "--enable-sleep-mode")
    try:
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log_text()


def answer(server) -> str:
    response = server.post("/v1/chat/completions", json={**CHAT, "model": server.model})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("level", [1, 2])
def test_asleep_the_server_answers_503_and_awake_it_answers_as_before(server, level):
    before = answer(server)
    assert server.post(f"/sleep?level={level}").json()["success"] is True
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = server.post("/v1/chat/completions", json={**CHAT, "model": server.model})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "engine_asleep"
    assert server.post("/wake_up").json()["success"] is True
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert answer(server) == before


def test_an_update_of_other_shapes_is_a_400_and_the_old_weights_keep_serving(server, tmp_path):
    before = answer(server)
    other = helpers.save_tiny_model(helpers.build_tiny_model("llama"), str(tmp_path / "tiny"))
    response = server.post("/update_weights_from_disk", json={"model_path": other})
    assert response.status_code == 400
    assert "vocab_size is 512, the serving model's is 49152" in response.json()["error"]["message"]
    missing = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nothing-here")})
    assert missing.status_code == 400 and "cannot read a model there" in missing.json()["error"]["message"]
    assert answer(server) == before


def test_an_update_from_the_served_file_keeps_the_answers(server):
    before = answer(server)
    path = server.get("/v1/models").json()["data"][0].get("root") or server.model
    response = server.post("/update_weights_from_disk", json={"model_path": path})
    assert response.status_code == 200, response.text
    assert answer(server) == before


def test_paused_generation_continues_after_continue(server):
    assert server.post("/pause_generation").json()["success"] is True
    assert server.post("/continue_generation").json()["success"] is True
    assert answer(server)
