"""pipetrain.jsonfile.read_json: the one reader of outside JSON (a checkpoint's manifest, a Hugging Face
config.json and weight index), bounded in size, failing with one line of its caller's error type."""
import json

import pytest

from pipetrain.checkpoint import read
from pipetrain.checkpoint.read import CorruptCheckpoint, read_manifest
from pipetrain.config import ConfigError
from pipetrain.hf import config as hf_config
from pipetrain.hf.config import read_hf_config
from pipetrain.jsonfile import read_json


def test_read_json_returns_the_value_within_the_bound(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"k": [1, 2]}))
    assert read_json(str(path), "where", ConfigError, "fix", len(path.read_bytes())) == {"k": [1, 2]}


@pytest.mark.parametrize("content,needle", [("x" * 40, "holds more than the 32 bytes"), ("{not json", "is not valid JSON"),
                                            (None, "cannot be read"), ("\udcff", "is not valid JSON")])
def test_read_json_fails_with_one_line_of_the_callers_error(tmp_path, content, needle):
    path = tmp_path / "a.json"
    if content is not None:
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(CorruptCheckpoint, match=rf"^where: .*a.json {needle}.*; fix$") as info:
        read_json(str(path), "where", CorruptCheckpoint, "fix", 32)
    assert "\n" not in str(info.value)


def test_an_oversized_manifest_is_damage_and_an_oversized_config_a_config_error(tmp_path, monkeypatch):
    """The bound sits in front of both callers: a manifest past it is a CorruptCheckpoint (--resume auto falls
    back to an older checkpoint), a config.json past it a ConfigError naming model.init_from."""
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "manifest.json").write_text(json.dumps({"format_version": 2, "pad": "x" * 200}))
    monkeypatch.setattr(read, "MANIFEST_MAX_BYTES", 100)
    with pytest.raises(CorruptCheckpoint, match="manifest.json holds more than the 100 bytes"):
        read_manifest(str(step))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "pad": "x" * 200}))
    monkeypatch.setattr(hf_config, "CONFIG_MAX_BYTES", 100)
    with pytest.raises(ConfigError, match=r"model.init_from: .*config.json holds more than the 100 bytes"):
        read_hf_config(str(tmp_path))
