"""Triton Python-backend entry point of the ``llm`` model.

Deliberately thin: everything lives in ``neuron_serving.triton.backend`` (tested
without Triton). The leader copies this model repository into its run directory and
sets PYTHONPATH for the backend stub to the directory holding ``neuron_serving`` and
the venv's site-packages (``neuron_serving/triton/repository.py``, ``stub_env``).
"""

import locale
import os
import site
import sys

# The stub's embedded interpreter ignores PYTHONPATH (seen here: the variable is in
# os.environ but not on sys.path), so apply it by hand, in front of the base
# interpreter's site-packages so the venv's pins (numpy 1.26) win; addsitedir also
# runs the venv's .pth files.
for _path in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
    if _path not in sys.path:
        sys.path.insert(0, _path)
        site.addsitedir(_path)

# The stub's embedded interpreter starts in the C locale, and `import vllm` then
# fails with UnicodeDecodeError ('ascii' codec); LANG/PYTHONUTF8 in the environment
# do not help. Must run before anything imports vllm.
locale.setlocale(locale.LC_ALL, "C.UTF-8")

import triton_python_backend_utils as pb_utils  # noqa: E402

from neuron_serving.triton.backend import LLMBackend  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.backend = LLMBackend(pb_utils)
        self.backend.initialize(args)

    def execute(self, requests):
        return self.backend.execute(requests)

    def finalize(self):
        self.backend.finalize()
