"""The run directory of one leader: backend directory, model repository, environment.

tritonserver finds the Python backend in ``--backend-directory``/python, which
must hold ``libtriton_python.so``, ``triton_python_backend_utils.py`` and the stub
built for *our* interpreter (``python_backend_stubs/3.11``; the wheel's default
stub is for another Python). The nvidia-pytriton wheel ships those pieces in
separate folders, so we assemble a backend directory from symlinks.

The model repository ships inside this package (``model_repository/``, package
data in the wheel) and is found through ``importlib.resources``, so an editable
install, ``pip install .`` and a wheel all find it. It is copied rather than used in
place so that the rendered ``model.json`` (the command line's overrides) never
touches the installed package and two leaders on one machine do not share it.
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving.openai_channel import CONFIG_PARAMETER

MODEL_NAME = "llm"
# The files tritonserver needs of the model: a test builds the wheel and checks each.
MODEL_FILES = (
    f"{MODEL_NAME}/config.pbtxt",
    f"{MODEL_NAME}/1/model.py",
    f"{MODEL_NAME}/1/model.json",
)


def model_repository() -> Path:
    """The packaged Triton model repository (``neuron_serving/triton/model_repository``).

    A directory on disk (pip installs packages unzipped): ``render_model_repository``
    copies it for tritonserver, which reads a model repository by path."""
    root = importlib.resources.files("neuron_serving.triton") / "model_repository"
    path = Path(str(root))
    missing = [f for f in MODEL_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"incomplete Triton model repository {path}: {', '.join(missing)} missing "
            "(reinstall neuron-serving; the wheel ships it as package data)"
        )
    return path


def import_root() -> Path:
    """The directory that holds the ``neuron_serving`` package (the checkout for an
    editable install, site-packages otherwise): first on the backend stub's path."""
    return Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class TritonInstall:
    """Where the nvidia-pytriton wheel put tritonserver and the Python backend."""

    root: Path  # .../site-packages/pytriton/tritonserver
    libs: Path  # .../site-packages/nvidia_pytriton.libs

    @classmethod
    def find(cls) -> TritonInstall:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "tritonserver not found: install it with `pip install numpy==1.26.4 nvidia-pytriton==0.7.0`"
            )
        pkg = Path(next(iter(spec.submodule_search_locations)))
        install = cls(root=pkg / "tritonserver", libs=pkg.parent / "nvidia_pytriton.libs")
        for path in (install.binary, install.python_backend, install.stub):
            if not path.exists():
                raise FileNotFoundError(f"incomplete tritonserver install: {path} is missing")
        return install

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def stub(self) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"


def assemble_backend_dir(install: TritonInstall, run_dir: Path) -> Path:
    backends = run_dir / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": install.python_backend / "libtriton_python.so",
        "triton_python_backend_utils.py": install.python_backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": install.stub,
    }
    for name, target in links.items():
        link = python / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return backends


def render_model_repository(run_dir: Path, overrides: dict[str, Any]) -> Path:
    """Copy the model repository into run_dir and merge ``overrides`` into llm's model.json."""
    from neuron_serving.triton.backend_config import BackendConfig

    repo = run_dir / "models"
    if repo.exists():
        shutil.rmtree(repo)
    shutil.copytree(model_repository(), repo, ignore=shutil.ignore_patterns("__pycache__"))
    model_json = repo / MODEL_NAME / "1" / "model.json"
    settings = json.loads(model_json.read_text())
    settings.update(overrides)
    config = BackendConfig.from_dict(settings)  # fail here, with the key's name
    model_json.write_text(json.dumps(settings, indent=2) + "\n")
    if config.openai_channel_port:
        # Where the proxy finds this leader's OpenAI channel (the host is the leader's
        # own); read with the checkpoint version below by the proxy's probes.
        with open(repo / MODEL_NAME / "config.pbtxt", "a", encoding="utf-8") as f:
            f.write(
                f'\nparameters {{\n  key: "{CONFIG_PARAMETER}"\n'
                f'  value {{ string_value: "{int(config.openai_channel_port)}" }}\n}}\n'
            )
    if config.model_version:
        # Readable by any Triton client (ModelConfig RPC / GET /v2/models/llm/config)
        # without a request: the proxy learns a unit's version from it. VERSION_RE
        # keeps the value safe to splice into the text protobuf.
        with open(repo / MODEL_NAME / "config.pbtxt", "a", encoding="utf-8") as f:
            f.write(
                '\nparameters {\n  key: "model_version"\n'
                f'  value {{ string_value: "{config.model_version}" }}\n}}\n'
            )
    return repo


def stub_env(install: TritonInstall, base: dict[str, str]) -> dict[str, str]:
    """Environment for tritonserver and, through it, the backend stub.

    The stub embeds libpython3.11 (LD_LIBRARY_PATH) and starts with an empty
    sys.path beyond the stdlib (PYTHONPATH: ``import_root()``, then the venv).
    """
    env = dict(base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ld = [str(install.libs), libdir, env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in ld if p)
    paths = [str(import_root()), *site.getsitepackages(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = ":".join(p for p in paths if p)
    return env
