"""The readout as an MLflow pyfunc model, so any MLflow client can load a version by alias and predict.

The model's artifacts are the leap_core readout file (`readout.leap`) and, when the version was
fitted with online correction, the RLS state (`rls_state.npz`). The leap_core and registry package
folders travel with the model as code paths, and a small entry file builds the model at load time
instead of unpickling one: the project is not on PyPI, and this way the model loads wherever mlflow,
numpy, scipy and scikit-learn are installed.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import Schema, TensorSpec

READOUT_FILE = "readout.leap"
RLS_STATE_FILE = "rls_state.npz"
READOUT_ARTIFACT = "readout"
RLS_STATE_ARTIFACT = "rls_state"
FEATURE_COLUMN = "feature"
# Hidden states are stored as float32; the signature's dtype check is strict, so callers cast once.
FEATURE_DTYPE = np.dtype("float32")

# The model is saved "from code" (MLflow's recommended form): this entry file is stored with the
# model and run at load time, so no pickled object has to be trusted.
_ENTRY_FILE = "readout_model.py"
_ENTRY_SOURCE = '''"""MLflow entry point of a LEAP readout model; the class ships in the code folder."""

from mlflow.models import set_model

from registry.model import ReadoutModel

set_model(ReadoutModel())
'''

# Lower bounds of what leap_core needs; exact pins would make the model refuse newer environments.
PIP_REQUIREMENTS = ("mlflow>=3.0", "numpy>=1.26", "scipy>=1.11", "scikit-learn>=1.5", "pandas>=2.0")


def feature_matrix(model_input: Any) -> np.ndarray:
    """Features as a row-major (n, d) array from an array, a DataFrame with a `feature` column of
    vectors, or a DataFrame with one numeric column per dimension.

    The dtype is kept (the readout computes float32 in float32), and rows are made contiguous: a
    DataFrame's column-major block would take another BLAS path and round differently.
    """
    if isinstance(model_input, pd.DataFrame):
        if FEATURE_COLUMN in model_input.columns:
            features = np.vstack([np.asarray(row) for row in model_input[FEATURE_COLUMN]])
        else:
            features = model_input.to_numpy()
    else:
        features = np.asarray(model_input)
    if features.ndim == 1:
        features = features.reshape(1, -1)
    return np.ascontiguousarray(features)


def readout_signature(dim: int) -> ModelSignature:
    """(n, dim) float32 in, (n,) predicted output lengths out."""
    return ModelSignature(
        inputs=Schema([TensorSpec(FEATURE_DTYPE, (-1, dim))]),
        outputs=Schema([TensorSpec(np.dtype("float64"), (-1,))]),
    )


class ReadoutModel(mlflow.pyfunc.PythonModel):
    """Predicts output lengths from prefill hidden states with a stored LEAP linear readout."""

    # The tensor signature already validates (n, d) inputs, which MLflow's type-hint validation
    # cannot express; skipping it keeps predict unwrapped.
    _skip_type_hint_validation = True

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        from leap_core.readout_format import from_bytes

        self.readout_ = from_bytes(Path(context.artifacts[READOUT_ARTIFACT]).read_bytes(), expect=None)
        # where a server that resumes online correction finds the stored RLS state (None if absent)
        self.rls_state_path_ = context.artifacts.get(RLS_STATE_ARTIFACT)

    # `model_input` is left unannotated: MLflow would read a hint there as a second input schema.
    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> np.ndarray:
        return np.asarray(self.readout_.predict(feature_matrix(model_input)), dtype=np.float64)


def _package_dir(package: str) -> str:
    return str(Path(importlib.import_module(package).__file__).resolve().parent)


def save_readout_model(path: str | Path, readout_file: str | Path, dim: int,
                       rls_state_file: str | Path | None = None,
                       input_example: np.ndarray | None = None) -> Path:
    """Write the pyfunc model folder at `path` (which must not exist or be empty).

    `input_example` (one or a few feature rows) is stored with the model so a server can show a
    valid request; without one, MLflow only has the signature.
    """
    with tempfile.TemporaryDirectory(prefix="leap-pyfunc-") as tmp:
        # MLflow keeps each artifact's file name; loaders look for the canonical names.
        artifacts = {READOUT_ARTIFACT: _with_name(readout_file, READOUT_FILE, tmp)}
        if rls_state_file is not None:
            artifacts[RLS_STATE_ARTIFACT] = _with_name(rls_state_file, RLS_STATE_FILE, tmp)
        entry = Path(tmp) / _ENTRY_FILE
        entry.write_text(_ENTRY_SOURCE)
        mlflow.pyfunc.save_model(
            path=str(path),
            python_model=str(entry),
            artifacts=artifacts,
            code_paths=[_package_dir("leap_core"), _package_dir("registry")],
            signature=readout_signature(dim),
            input_example=None if input_example is None else np.asarray(input_example, dtype=FEATURE_DTYPE),
            pip_requirements=list(PIP_REQUIREMENTS),
        )
    return Path(path)


def _with_name(source: str | Path, name: str, folder: str) -> str:
    source = Path(source)
    if source.name == name:
        return str(source)
    target = Path(folder) / name
    shutil.copyfile(source, target)
    return str(target)
