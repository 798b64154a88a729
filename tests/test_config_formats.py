"""Config files in YAML and TOML as well as JSON: ``read_source("@file")`` picks by the suffix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

from hicache_storage.config import load_config, read_source
from hicache_storage.errors import ConfigError

OPTIONS = {
    "backend": "file",
    "options": {"root": "/data/kv", "max_bytes": 68719476736, "fsync": True, "low_watermark": 0.8},
    "deployment": {"model_name": "llama", "tp_rank": 1, "tp_size": 2},
    "layers": {"metrics": False},
}

JSON_TEXT = json.dumps(OPTIONS)

YAML_TEXT = """\
# The same config as JSON_TEXT.
backend: file
options:
  root: /data/kv
  max_bytes: 68719476736
  fsync: true
  low_watermark: 0.8
deployment:
  model_name: llama
  tp_rank: 1
  tp_size: 2
layers:
  metrics: false
"""

TOML_TEXT = """\
# The same config as JSON_TEXT.
backend = "file"

[options]
root = "/data/kv"
max_bytes = 68719476736
fsync = true
low_watermark = 0.8

[deployment]
model_name = "llama"
tp_rank = 1
tp_size = 2

[layers]
metrics = false
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    written = {
        "json": tmp_path / "hicache.json",
        "yaml": tmp_path / "hicache.yaml",
        "yml": tmp_path / "hicache.YML",
        "toml": tmp_path / "hicache.toml",
    }
    written["json"].write_text(JSON_TEXT)
    written["yaml"].write_text(YAML_TEXT)
    written["yml"].write_text(YAML_TEXT)
    written["toml"].write_text(TOML_TEXT)
    return written


@pytest.mark.parametrize("kind", ["yaml", "yml", "toml"])
def test_yaml_and_toml_give_what_json_gives(files: dict[str, Path], kind: str) -> None:
    expected = read_source(f"@{files['json']}")
    assert expected == OPTIONS
    assert read_source(f"@{files[kind]}") == expected
    assert read_source(files[kind]) == expected  # a Path as well as "@path"
    assert load_config(f"@{files[kind]}", env={}) == load_config(f"@{files['json']}", env={})


def test_hicache_config_variable_reads_toml(files: dict[str, Path]) -> None:
    loaded = load_config(env={"HICACHE_CONFIG": f"@{files['toml']}"})
    assert loaded.backend == "file"
    assert loaded.deployment.tp_rank == 1


def test_other_suffixes_stay_json(tmp_path: Path) -> None:
    path = tmp_path / "hicache.conf"
    path.write_text(JSON_TEXT)
    assert read_source(f"@{path}") == OPTIONS
    path.write_text(YAML_TEXT)
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_source(f"@{path}")


def test_yaml_without_pyyaml_says_how_to_install_it(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    with pytest.raises(ConfigError, match="pip install pyyaml") as caught:
        read_source(f"@{files['yaml']}")
    assert "hicache.yaml" in str(caught.value)
    assert read_source(f"@{files['json']}") == OPTIONS  # JSON and TOML need no PyYAML
    assert read_source(f"@{files['toml']}") == OPTIONS


def test_toml_without_a_parser_says_how_to_install_one(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ConfigError, match="pip install tomli"):
        read_source(f"@{files['toml']}")


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("bad.yaml", "a: [1,\n", "is not valid YAML"),
        ("bad.toml", "a = \n", "is not valid TOML"),
        ("list.yaml", "- 1\n- 2\n", "must be a YAML mapping, got list"),
        ("key.yaml", "1: x\n", "has the key 1, which is not text"),
        ("deep.yaml", "a: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 32"),
        ("wide.yaml", "a: 123456789012345678901234567890\n", "integer of"),
        ("deep.toml", "a = " + "[" * 40 + "1" + "]" * 40 + "\n", "nested deeper than 32"),
        (
            "bomb.yaml",
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
            "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
            "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
            "f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
            "expands to more than 100000 values",
        ),
        ("python.yaml", "a: !!python/object/apply:os.system ['true']\n", "is not valid YAML"),
    ],
)
def test_bad_files_are_config_errors(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        read_source(f"@{path}")
    assert says in str(caught.value)


def test_empty_yaml_is_an_empty_config(tmp_path: Path) -> None:
    path = tmp_path / "empty.yml"
    path.write_text("# nothing here yet\n")
    assert read_source(f"@{path}") == {}


def test_yaml_dates_are_refused_by_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "date.yaml"
    path.write_text("backend: file\ndeployment:\n  model_name: 2024-01-01\n")
    with pytest.raises(ConfigError, match="model_name"):
        load_config(f"@{path}", env={})


def test_toml_bytes_decode_like_the_settings_reader() -> None:
    # The same parser as `--settings FILE.toml` (msgspec.toml): one implementation of TOML here.
    assert msgspec.toml.decode(TOML_TEXT.encode()) == OPTIONS
