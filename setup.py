"""The project is described in pyproject.toml; this file adds one step to setuptools' build: the wheel's
top level gets ``paddle_fullparam_callbacks.pth``, the startup hook of ``PADDLE_FULLPARAM_RECIPE``
(docs/without-code.md). Python runs its one line in every process of the environment: it does nothing
unless that variable is set. Its text lives in ``paddle_fullparam_callbacks/trainer/autoattach/``."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path("paddle_fullparam_callbacks") / "trainer" / "autoattach" / "paddle_fullparam_callbacks.pth"


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):  # an editable install uses `paddle-fullparam run`'s path
            self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        extra = [] if getattr(self, "editable_mode", False) else [str(Path(self.build_lib) / PTH.name)]
        return super().get_outputs(include_bytecode) + extra


setup(cmdclass={"build_py": BuildPyWithStartupHook})
