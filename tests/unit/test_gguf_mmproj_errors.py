"""What `--mmproj` refuses, each with one line that names the file and the reason: a model folder, a missing,
corrupt or non-mmproj file, a projector type tokenloom does not compute, a text model the projector cannot feed,
a projector whose width is not the text model's."""
from __future__ import annotations

import gguf
import helpers
import mmproj_helpers
import pytest

from tokenloom import LLM
from tokenloom.config import ConfigError, EngineConfig
from tokenloom.entrypoints.cli import build_parser
from tokenloom.multimodal.mmproj_config import gguf_vision_config


@pytest.fixture(scope="module")
def llava_files(tiny_llava, tmp_path_factory):
    """(folder, text GGUF, mmproj, tmp dir)."""
    folder, hf = tiny_llava
    tmp = tmp_path_factory.mktemp("mmproj_errors")
    text = mmproj_helpers.write_llava_text_gguf(hf, folder, str(tmp / "text.gguf"))
    return folder, text, mmproj_helpers.write_mmproj(folder, str(tmp / "mmproj.gguf")), tmp


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_mmproj_with_a_safetensors_folder_is_refused(llava_files):
    folder, _, mmproj, _ = llava_files
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_kwargs(model=folder, mmproj=mmproj)
    assert "--mmproj goes with a GGUF model file" in _one_line(exc)


def test_a_missing_mmproj_file_is_refused(llava_files, tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_kwargs(model=llava_files[1], mmproj=missing)
    assert _one_line(exc) == f"--mmproj {missing}: no such file"


def test_a_corrupt_mmproj_file_is_refused_at_start_up(llava_files, tmp_path):
    _, text, mmproj, _ = llava_files
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(mmproj, "rb").read()[:200])
    with pytest.raises(ConfigError) as exc:
        LLM(text, mmproj=str(cut), progress=False, device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    assert f"--mmproj {cut}: not a readable GGUF file" in _one_line(exc)


def test_a_text_gguf_given_as_the_mmproj_is_refused(llava_files):
    _, text, _, _ = llava_files
    with pytest.raises(ConfigError) as exc:
        gguf_vision_config(text, text)
    assert "not an mmproj file (general.architecture 'llama', want 'clip')" in _one_line(exc)


def test_an_unsupported_projector_type_is_named_with_the_supported_ones(tmp_path, llava_files):
    path = str(tmp_path / "ldp.gguf")
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", "ldp")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError) as exc:
        gguf_vision_config(llava_files[1], path)
    assert _one_line(exc) == (f"--mmproj {path}: projector type 'ldp' is not supported (supported: mlp, gemma3, "
                              f"qwen2.5vl_merger)")


def test_a_text_architecture_the_projector_does_not_feed_is_refused(llava_files, tmp_path):
    qwen3 = helpers.write_tiny_gguf(helpers.build_tiny_model("qwen3"), "qwen3", str(tmp_path / "qwen3.gguf"), {})
    with pytest.raises(ConfigError) as exc:
        gguf_vision_config(qwen3, llava_files[2])
    assert "a 'qwen3' text model cannot take the images of a 'mlp' projector" in _one_line(exc)


def test_a_qwen2_5_vl_mmproj_needs_the_qwen2vl_text_model_with_its_rope_sections(tiny_qwen2_5_vl, tmp_path):
    folder, _ = tiny_qwen2_5_vl
    mmproj = mmproj_helpers.write_mmproj(folder, str(tmp_path / "mmproj.gguf"))
    qwen2 = helpers.write_tiny_gguf(helpers.build_tiny_model("qwen2"), "qwen2", str(tmp_path / "qwen2.gguf"), {})
    with pytest.raises(ConfigError) as exc:
        gguf_vision_config(qwen2, mmproj)
    assert "a 'qwen2' text model cannot take the images of a 'qwen2.5vl_merger' projector" in _one_line(exc)
    assert "it feeds qwen2vl" in str(exc.value)


def test_an_mmproj_narrower_than_the_text_model_is_refused_at_start_up(llava_files, tmp_path):
    wide = helpers.write_tiny_gguf(helpers.build_tp3_model(), "llama", str(tmp_path / "wide.gguf"), {})
    with pytest.raises(ConfigError) as exc:
        LLM(wide, mmproj=llava_files[2], progress=False, device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    assert "its image embeddings are 64 wide but the text model" in _one_line(exc)
    assert "has hidden size 96" in str(exc.value)


def test_the_mmproj_flag_is_parsed_on_every_model_command(llava_files):
    _, text, mmproj, _ = llava_files
    commands = {"serve": [text], "generate": ["hello", "-m", text], "chat": ["-m", text],
                "run-batch": ["-i", "in.jsonl", "-o", "out.jsonl", "-m", text]}
    for command, args in commands.items():
        ns = build_parser().parse_args([command, *args, "--mmproj", mmproj])
        assert ns.mmproj == mmproj, command
