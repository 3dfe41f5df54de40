"""Typed configs and the family registry: a bad config.json is one line naming its key, for every family; no family
module imports another."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from moelane.errors import ModelLoadError
from moelane.model.family import FAMILIES, family_of
from tests.helpers import FAMILY_CONFIGS

FAMILIES_DIR = Path(__file__).parents[2] / "src" / "moelane" / "model" / "families"


def config_of(family: str) -> dict[str, Any]:
    return {**FAMILY_CONFIGS[family][2], "model_type": family}


def one_line_naming(error: pytest.ExceptionInfo[ModelLoadError], key: str) -> None:
    message = str(error.value)
    assert "\n" not in message and (repr(key) in message or f" {key} " in message), message


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_every_family_reads_its_test_config(family: str) -> None:
    kind = family_of(family)
    config = kind.config_class.from_dict(config_of(family))
    assert config.model_type == family and kind.build(config).moe_layers == config.moe_layers()


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_a_missing_required_key_is_one_line_naming_it(family: str) -> None:
    config_class = family_of(family).config_class
    spellings = {names[0]: names for names in config_class.keys().values()}
    assert config_class.required()  # (every family needs at least its sizes)
    for key in config_class.required():
        config = {name: value for name, value in config_of(family).items() if name not in spellings[key]}
        with pytest.raises(ModelLoadError) as error:
            config_class.from_dict(config)
        one_line_naming(error, key)


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_a_value_of_the_wrong_type_is_one_line_naming_its_key(family: str) -> None:
    config_class = family_of(family).config_class
    read = {name for names in config_class.keys().values() for name in names}
    checked = [key for key in config_of(family) if key in read]
    assert len(checked) >= 5
    for key in checked:
        value = config_of(family)[key]
        wrong = 7 if isinstance(value, str) else "seven"
        with pytest.raises(ModelLoadError) as error:
            config_class.from_dict({**config_of(family), key: wrong})
        one_line_naming(error, key)
        assert repr(wrong) in str(error.value)


def test_every_model_type_has_a_family() -> None:
    for model_type in FAMILIES:
        assert family_of(model_type).config_class.__name__.endswith("Config")
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt9'; supported: qwen3_moe, qwen2_moe"):
        family_of("gpt9")


def test_no_family_imports_another() -> None:
    """A family module imports shared modules (`moelane.model.*`) only: what two families share lives there."""
    files = sorted(FAMILIES_DIR.glob("*.py"))
    assert len(files) > 20
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] if node.level == 0 else ["moelane.model.families"]
                modules += [f"{node.module}.{alias.name}" for alias in node.names if node.level == 0 and node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            imported = [m for m in modules if m == "moelane.model.families" or m.startswith("moelane.model.families.")]
            assert not imported, f"{file.name} imports {imported}"
