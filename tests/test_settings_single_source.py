"""One settings class reads `LEAP_*`: no other module of the installed packages reads such a variable.

The check walks the syntax tree of every module of the packages pyproject.toml installs and lists each
read of the environment: `os.environ[...]`, `os.environ.get/pop/setdefault(...)`, `os.getenv(...)`,
`environ.get(...)` (an `environ` imported from os or handed in), and `... in os.environ`. A read whose
name is a string literal, or a module constant bound to one, is a LEAP_* read when the name starts with
LEAP_; any other name is a non-literal read, listed too. Only leap_io/settings.py may read LEAP_*, and
no module may read a name the check cannot see.
"""

from __future__ import annotations

import ast
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_MODULE = "leap_io/settings.py"
READ_METHODS = {"get", "pop", "setdefault"}
NOT_SETTINGS = {
    ("ops/fleet_env.py", "key not in environ"):
        "the fleet's variables are set where the environment has none (a default, like setdefault): no value "
        "is read, and the settings then read them as any other",
}
"""Reads the check lists but allows, each with why: (path, source) -> reason."""


@dataclass(frozen=True)
class EnvRead:
    path: str
    line: int
    name: str | None  # the variable's name, or None when the check cannot tell it
    source: str

    @property
    def leap(self) -> bool:
        return self.name is not None and self.name.startswith("LEAP_")


def product_packages() -> list[str]:
    """The packages pyproject.toml installs (`[tool.setuptools.packages.find] include`)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in patterns})


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "getenv"


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" bindings, so `os.environ.get(SOME_ENV)` reads a known name."""
    found: dict[str, str] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def environment_reads(source: str, path: str = "<string>") -> list[EnvRead]:
    """Every read of the environment in `source`, in line order."""
    tree = ast.parse(source)
    constants = _constants(tree)

    def name_of(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        return None

    reads: list[EnvRead] = []

    def add(node: ast.AST, key: ast.AST | None) -> None:
        reads.append(EnvRead(path, node.lineno, name_of(key), ast.get_source_segment(source, node) or ""))

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            add(node, node.slice)
        elif isinstance(node, ast.Call):
            func = node.func
            key = node.args[0] if node.args else None
            if _is_getenv(func):
                add(node, key)
            elif isinstance(func, ast.Attribute) and func.attr in READ_METHODS and _is_environ(func.value):
                add(node, key)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_environ(right) for right in node.comparators):
                add(node, node.left)
    return sorted(reads, key=lambda read: read.line)


def product_reads() -> list[EnvRead]:
    reads: list[EnvRead] = []
    for package in product_packages():
        for file in sorted((ROOT / package).rglob("*.py")):
            relative = file.relative_to(ROOT).as_posix()
            reads.extend(environment_reads(file.read_text(), relative))
    return reads


def check_single_source(reads: list[EnvRead]) -> None:
    """AssertionError listing every LEAP_* read outside the settings module, and every read whose name the
    check cannot see."""
    elsewhere = [read for read in reads
                 if read.path != SETTINGS_MODULE and (read.path, read.source) not in NOT_SETTINGS]
    leap = [f"{read.path}:{read.line}: {read.source}" for read in elsewhere if read.leap]
    assert not leap, "LEAP_* read outside leap_io/settings.py (read it from LeapSettings):\n" + "\n".join(leap)
    unknown = [f"{read.path}:{read.line}: {read.source}" for read in elsewhere if read.name is None]
    assert not unknown, ("environment reads whose variable the check cannot name (a LEAP_* one would pass "
                         "unseen; use a literal, or read it through LeapSettings):\n" + "\n".join(unknown))


def test_only_the_settings_module_reads_leap_variables():
    assert (ROOT / SETTINGS_MODULE).is_file()
    check_single_source(product_reads())


def test_the_reads_it_finds_are_the_environment_reads_of_the_product():
    """The detector sees the product's non-LEAP reads (vLLM's, AWS's, MLflow's), so it is looking."""
    names = {read.name for read in product_reads()}
    assert "AWS_DEFAULT_REGION" in names
    assert "PYTHONPATH" in names


PLANTED = '''
import os
from os import environ, getenv

HOME_ENV = "LEAP_HOME"
a = os.environ["LEAP_POLICY"]
b = os.environ.get("LEAP_ADMIN_PORT", "8011")
c = os.getenv("LEAP_LAYER")
d = environ.get(HOME_ENV)
e = getenv("VLLM_LOGGING_LEVEL")
f = "LEAP_CAPTURE" in os.environ
g = os.environ.pop("LEAP_REPLICA_ID", None)
name = "LEAP_" + "ORDER"
h = os.environ.get(name)
os.environ["LEAP_SET_FOR_A_CHILD"] = "1"
env = dict(os.environ, LEAP_HOME="/tmp/x")
'''


def test_the_check_finds_a_planted_read():
    reads = environment_reads(PLANTED, "planted.py")
    assert [read.name for read in reads if read.leap] == ["LEAP_POLICY", "LEAP_ADMIN_PORT", "LEAP_LAYER",
                                                           "LEAP_HOME", "LEAP_CAPTURE", "LEAP_REPLICA_ID"]
    assert [read.name for read in reads if not read.leap] == ["VLLM_LOGGING_LEVEL", None]
    assert [read.line for read in reads if read.name is None] == [14]  # the computed name


def test_the_check_would_fail_on_a_planted_read():
    """The product check, given a module that reads LEAP_HOME itself (or a name it cannot see), fails."""
    planted = environment_reads('import os\nhome = os.environ.get("LEAP_HOME", ".leap")\n', "leap_io/paths.py")
    with pytest.raises(AssertionError, match=r"leap_io/paths.py:2: os.environ.get\(\"LEAP_HOME\""):
        check_single_source(planted)
    hidden = environment_reads("import os\nkey = 'LEAP_' + 'HOME'\nhome = os.environ[key]\n", "ops/x.py")
    with pytest.raises(AssertionError, match=r"cannot name.*\n.*ops/x.py:3"):
        check_single_source(hidden)
    check_single_source(environment_reads(PLANTED.replace("os.environ.get(name)", "None"), SETTINGS_MODULE))


def test_a_bad_value_fails_when_the_settings_are_read(monkeypatch):
    from leap_io.settings import read_settings

    monkeypatch.setenv("LEAP_ADMIN_PORT", "not-a-port")
    with pytest.raises(ValidationError, match="admin_port"):
        read_settings()


def test_serving_and_pipeline_read_one_value(monkeypatch, tmp_path):
    """The nine settings the two sides share come from the one class: the same value on both sides."""
    from flows.settings import PipelineSettings
    from leap_io.settings import LeapSettings
    from serving.config import LeapConfig

    assert PipelineSettings is LeapSettings
    assert issubclass(LeapSettings, __import__("leap_io.settings", fromlist=["ServingSection"]).ServingSection)
    for key in list(os.environ):
        if key.startswith("LEAP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    monkeypatch.setenv("LEAP_ADMIN_PORT", "8123")
    monkeypatch.setenv("LEAP_RECIPES", "last@17, last@17+mean@17,last@17")
    monkeypatch.setenv("LEAP_LAYER", "17")
    monkeypatch.setenv("LEAP_FEEDBACK_URL", "s3://leap-feedback/fleet")
    settings, config = LeapSettings(), LeapConfig.from_environment()
    for name in ("admin_port", "recipes", "layer", "feedback_url"):
        assert getattr(settings, name) == getattr(config, name), name
    assert config.recipes == ("last@17", "last@17+mean@17")
    assert config.champion_url == settings.champion_url == str(tmp_path.resolve() / "champion")
    # unset, a serving process runs no admin server and writes no feedback; the pipeline derives them
    monkeypatch.delenv("LEAP_ADMIN_PORT")
    settings, config = LeapSettings(), LeapConfig.from_environment()
    assert (config.admin_port, config.feedback_dir, config.admin_token_file) == (None, None, None)
    assert settings.admin_port == 8011
    assert settings.feedback_dir == str(tmp_path.resolve() / "feedback")
    assert settings.admin_token_file == str(tmp_path.resolve() / "admin.token")
    # keyword arguments win over the environment; a plain LeapConfig reads none
    assert LeapConfig.from_environment(layer=22).layer == 22
    assert LeapConfig().layer is None


def test_a_mapping_reads_its_own_leap_keys(monkeypatch, tmp_path):
    from leap_io.settings import LeapSettings

    monkeypatch.setenv("LEAP_HOME", str(tmp_path / "process"))
    settings = LeapSettings.from_environ({"LEAP_HOME": str(tmp_path / "given"), "LEAP_REPLICAS": "3",
                                          "OTHER": "x"})
    assert settings.home == (tmp_path / "given").resolve() and settings.replicas == 3
    assert settings.given("replicas") and not settings.given("layer")
    assert LeapSettings.from_environ(os.environ).home == (tmp_path / "process").resolve()


def test_a_derived_default_is_not_given(tmp_path):
    """The defaults derived from the home are the settings' own, not given: a serving process gets none of
    them, and no registry is named where none exists."""
    from leap_io.settings import LeapSettings

    settings = LeapSettings.from_environ({"LEAP_HOME": str(tmp_path), "LEAP_ADMIN_PORT": "9001"})
    assert settings.endpoints == ["http://127.0.0.1:9001"] and settings.duckdb_path == tmp_path.resolve() / "leap.duckdb"
    assert {name for name in LeapSettings.model_fields if settings.given(name)} == {"home", "admin_port"}
    assert settings.serving_values() == {"admin_port": 9001, "champion_url": str(tmp_path.resolve() / "champion")}
    assert settings.serving_registry_uri() is None  # no stack, no database under the home
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "mlflow.db").write_bytes(b"")
    assert settings.serving_registry_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow/mlflow.db"
